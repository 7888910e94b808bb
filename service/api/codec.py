"""Protobuf messages to validated numpy rows and back: the only module that touches both.

Every check names the offending field the way the caller wrote it (``features['amount']``,
``requests[3].history[7].values``, ``inputs[1].shape``) so a bad request can be fixed from the
status message alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass

from engines.manifest import Manifest
from inference import grpc_service_pb2 as oip
from riskscoring.v1 import risk_scoring_pb2 as pb
from service.batching.rows import RowBatch
from service.errors import InvalidRequest

__all__ = [
    "DECISIONS",
    "check_ranges",
    "check_requested_outputs",
    "checked_model_name",
    "decode_infer_request",
    "decode_infer_together",
    "decode_score_batch",
    "decode_score_request",
    "encode_infer_response",
]

DECISIONS = {"APPROVE": pb.APPROVE, "REVIEW": pb.REVIEW, "DECLINE": pb.DECLINE}


def _finite(values: np.ndarray, field: str, manifest: Manifest) -> np.ndarray:
    if np.isfinite(values).all():
        return values
    if manifest.nan_policy == "zero":
        return np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    raise InvalidRequest(field, "NaN or infinite values are not allowed by this model")


def _feature_vector(features: object, manifest: Manifest, prefix: str) -> np.ndarray:
    names = manifest.features
    try:
        if len(features) != len(names):  # type: ignore[arg-type]
            raise KeyError
        # A missing name reads as None, which numpy refuses (TypeError): the slow path below
        # then says which.
        values = np.fromiter(
            map(features.get, names),  # type: ignore[attr-defined]
            dtype=np.float32,
            count=len(names),
        )
    except (KeyError, TypeError):
        fmap = dict(features)  # type: ignore[call-overload]
        unknown = sorted(set(fmap) - set(names))
        if unknown:
            raise InvalidRequest(f"{prefix}features[{unknown[0]!r}]", "unknown feature") from None
        missing = [n for n in names if n not in fmap]
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise InvalidRequest(f"{prefix}features", f"missing {len(missing)}: {shown}") from None
    if not np.isfinite(values).all():
        bad = next(n for n, v in zip(names, values, strict=True) if not np.isfinite(v))
        values = _finite(values, f"{prefix}features[{bad!r}]", manifest)
    return values


def _rows_view_class() -> Any:
    """A message with ScoreRequest's history field as `repeated bytes`: parsing a request's
    bytes with it gives each history row's own wire bytes, which numpy reads whole."""
    history = pb.ScoreRequest.DESCRIPTOR.fields_by_name["history"]
    file = descriptor_pb2.FileDescriptorProto(
        name="riskserve_history_rows.proto", package="riskserve.codec", syntax="proto3"
    )
    message = file.message_type.add(name="HistoryRows")
    message.field.add(
        name="history",
        number=history.number,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return GetMessageClass(pool.FindMessageTypeByName("riskserve.codec.HistoryRows"))


_HistoryRows = _rows_view_class()
_VALUES_TAG = 1 << 3 | 2  # HistoryRow.values (field 1), packed: length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _rows_from_wire(request: pb.ScoreRequest, width: int) -> np.ndarray | None:
    """The history as an (n, width) float32 matrix read from the rows' wire bytes at once, or
    None where a row is not exactly `width` packed floats (the per-value path then says why).

    A row of `width` packed floats is its field's tag, the byte length as a varint, then the
    little-endian floats, so rows that all have the width are equal-sized records: one numpy
    view checks every header and takes every value, with nothing done per value in Python.
    """
    rows = _HistoryRows.FromString(request.SerializeToString()).history
    header = bytes([_VALUES_TAG]) + _varint(4 * width)
    size = len(header) + 4 * width
    blob = b"".join(rows)
    if len(blob) != len(rows) * size:
        return None
    records = np.frombuffer(blob, dtype=np.uint8).reshape(len(rows), size)
    if not (records[:, : len(header)] == np.frombuffer(header, dtype=np.uint8)).all():
        return None
    return records[:, len(header) :].copy().view("<f4").astype(np.float32, copy=False)


def _history_matrix(
    rows: Sequence[pb.HistoryRow],
    manifest: Manifest,
    prefix: str,
    request: pb.ScoreRequest | None = None,
) -> np.ndarray:
    """`request`, where given, is the message holding `rows`: read from its wire bytes."""
    spec = manifest.history
    if spec is None:
        if rows:
            raise InvalidRequest(f"{prefix}history", "this model takes no history")
        return np.zeros((0, 0), dtype=np.float32)
    width = len(spec.fields)
    if len(rows) > spec.max_length:
        raise InvalidRequest(
            f"{prefix}history", f"{len(rows)} rows exceed the limit of {spec.max_length}"
        )
    if request is not None and rows:
        matrix = _rows_from_wire(request, width)
        if matrix is not None:
            return _finite(matrix, f"{prefix}history", manifest)
    for i, row in enumerate(rows):
        if len(row.values) != width:
            raise InvalidRequest(
                f"{prefix}history[{i}].values",
                f"has {len(row.values)} values, expected {width} ({', '.join(spec.fields)})",
            )
    flat = np.fromiter(
        itertools.chain.from_iterable(r.values for r in rows),
        dtype=np.float32,
        count=len(rows) * width,
    )
    matrix = flat.reshape(len(rows), width)
    return _finite(matrix, f"{prefix}history", manifest)


def check_ranges(
    features: np.ndarray,
    manifest: Manifest,
    field_template: str,
    positions: Sequence[int] | None = None,
) -> None:
    """Refuse any value outside the manifest's declared range for its feature.

    `features` is (n, F) in manifest order; `field_template` names a bad value's field from
    its `{row}` and `{feature}` name (``"requests[{row}].features[{feature!r}]"``), `{row}`
    being the row's place in `positions` where given. NaN passes here: the NaN policy has
    dealt with it already.
    """
    bounds = manifest.feature_bounds
    if bounds is None:
        return
    low, high = bounds.low, bounds.high
    outside = (features < low) | (features > high)
    if not outside.any():
        return
    row, column = (int(i) for i in np.argwhere(outside)[0])
    name = manifest.features[column]
    named_row = row if positions is None else positions[row]
    raise InvalidRequest(
        field_template.format(row=named_row, feature=name),
        f"{float(features[row, column]):g} is outside the model's range "
        f"[{float(low[column]):g}, {float(high[column]):g}]",
    )


def check_requested_outputs(request: oip.ModelInferRequest, served: str) -> None:
    """An OIP request may ask only for the output the model serves, `served` (as Triton
    refuses others)."""
    for i, output in enumerate(request.outputs):
        if output.name != served:
            raise InvalidRequest(
                f"outputs[{i}].name",
                f"{output.name!r} is not an output of this model (it has {served!r})",
            )
        if "classification" in output.parameters:  # Triton's class labels: not a score
            raise InvalidRequest(
                f"outputs[{i}].parameters['classification']", "is not supported: ask for the score"
            )


def checked_model_name(name: str, field: str = "model_name") -> str:
    """An OIP request's model name, which must not be empty (OIP has no default model)."""
    if not name:
        raise InvalidRequest(field, "is empty")
    return name


def decode_score_request(
    request: pb.ScoreRequest, manifest: Manifest, prefix: str = ""
) -> RowBatch:
    vector = _feature_vector(request.features, manifest, prefix)
    history = _history_matrix(request.history, manifest, prefix, request)
    rows = RowBatch.single(vector, history, manifest.history)
    check_ranges(rows.features, manifest, prefix + "features[{feature!r}]")
    return rows


def decode_score_batch(
    request: pb.ScoreBatchRequest, manifest: Manifest, positions: Sequence[int] | None = None
) -> tuple[RowBatch, ...]:
    """The items at `positions` (None: all), one row each, unpadded (the batcher pads them with
    the rest of their batch), checked against `manifest`, the model version that answers
    them; a field is named by its item's place in the request."""
    items = request.requests
    if positions is None:
        positions = range(len(items))
    n = len(positions)
    if n == 0:
        raise InvalidRequest("requests", "is empty")
    if n > manifest.max_batch_size:
        raise InvalidRequest("requests", f"{n} rows exceed the limit of {manifest.max_batch_size}")
    parts = []
    for i in positions:
        item = items[i]
        prefix = f"requests[{i}]."
        if item.model and item.model != request.model:
            raise InvalidRequest(f"{prefix}model", "must be empty or equal the batch's model")
        if item.model_version and item.model_version != request.model_version:
            raise InvalidRequest(
                f"{prefix}model_version", "must be empty or equal the batch's model_version"
            )
        vector = _feature_vector(item.features, manifest, prefix)
        history = _history_matrix(item.history, manifest, prefix, item)
        parts.append(RowBatch.single(vector, history, manifest.history))
    features = np.concatenate([part.features for part in parts])
    check_ranges(features, manifest, "requests[{row}].features[{feature!r}]", positions)
    return tuple(parts)


_OIP_DTYPES = {"FP32": np.float32}


def _tensor(
    raw_contents: Sequence[bytes], index: int, tensor: oip.ModelInferRequest.InferInputTensor
) -> np.ndarray:
    """Input `index` as an array of its shape; `raw_contents` is the request's raw inputs."""
    field = f"inputs[{index}]"
    if tensor.datatype not in _OIP_DTYPES:
        raise InvalidRequest(f"{field}.datatype", f"{tensor.datatype!r} is not FP32")
    shape = tuple(tensor.shape)  # Python ints (int64 in the message)
    if shape and min(shape) < 0:
        raise InvalidRequest(f"{field}.shape", f"{list(shape)} has a negative dimension")
    count = math.prod(shape)  # exact: numpy's int64 product wraps around on huge shapes
    if raw_contents:
        if tensor.HasField("contents"):
            raise InvalidRequest(f"{field}.contents", "must not be given with raw_input_contents")
        raw = raw_contents[index]
        if len(raw) != count * 4:
            raise InvalidRequest(
                f"raw_input_contents[{index}]",
                f"has {len(raw)} bytes, shape {list(shape)} of FP32 needs {count * 4}",
            )
        values = np.frombuffer(raw, dtype="<f4")
    else:
        contents = tensor.contents.fp32_contents
        if len(contents) != count:
            raise InvalidRequest(
                f"{field}.contents.fp32_contents",
                f"has {len(contents)} values, shape {list(shape)} needs {count}",
            )
        values = np.array(contents, dtype=np.float32)
    try:
        return values.reshape(shape)
    except ValueError as exc:  # no values, and dimensions numpy cannot hold: too large or many
        raise InvalidRequest(
            f"{field}.shape", f"{list(shape)} has dimensions too large or too many"
        ) from exc


def decode_infer_request(
    request: oip.ModelInferRequest, manifest: Manifest, served: str
) -> RowBatch:
    """OIP tensors named as the model's ONNX inputs, checked against the manifest; `served` is
    the name of the score's output tensor (`ScoreOutput.served_name`)."""
    check_requested_outputs(request, served)
    return _infer_rows(_infer_arrays(request, manifest), manifest)


def decode_infer_together(
    requests: Sequence[oip.ModelInferRequest], manifest: Manifest, served: str
) -> RowBatch | None:
    """The rows of OIP requests alike in their tensors (names, types, shapes, raw contents),
    decoded as one batch, in order: the first request's tensors are checked in full, the
    others' against them, and every value at once. None where the requests differ or a check
    fails: decoded one by one instead, each error names its own request's field."""
    first = requests[0]
    raw_first = first.raw_input_contents
    if not raw_first:
        return None
    try:
        check_requested_outputs(first, served)
        arrays = _infer_arrays(first, manifest)
    except InvalidRequest:
        return None
    # The others' tensor headers and requested outputs equal the first's, compared whole (in
    # C, a message at a time); each raw input the same size as the first's.
    inputs, outputs = first.inputs, first.outputs
    sizes = list(map(len, raw_first))
    for request in requests[1:]:
        if request.inputs != inputs or request.outputs != outputs:
            return None
        if list(map(len, request.raw_input_contents)) != sizes:
            return None
    tensors = [(t.name, list(t.shape)) for t in inputs]
    n = len(requests)
    for i, (name, shape) in enumerate(tensors):
        joined = b"".join([request.raw_input_contents[i] for request in requests])
        arrays[name] = np.frombuffer(joined, dtype="<f4").reshape((n * shape[0], *shape[1:]))
    try:
        return _infer_rows(arrays, manifest)
    except InvalidRequest:
        return None


def _infer_arrays(request: oip.ModelInferRequest, manifest: Manifest) -> dict[str, np.ndarray]:
    """A request's tensors by name, each checked against the input it names."""
    spec = manifest.history
    expected = {manifest.features_input: 2}
    if spec is not None:
        expected |= {spec.input: 3, spec.mask_input: 2}
    arrays: dict[str, np.ndarray] = {}
    raw_contents = request.raw_input_contents
    if raw_contents and len(raw_contents) != len(request.inputs):
        raise InvalidRequest(
            "raw_input_contents",
            f"has {len(raw_contents)} entries for {len(request.inputs)} inputs",
        )
    for i, tensor in enumerate(request.inputs):
        if tensor.name not in expected:
            raise InvalidRequest(
                f"inputs[{i}].name", f"{tensor.name!r} is not one of {sorted(expected)}"
            )
        if tensor.name in arrays:
            raise InvalidRequest(f"inputs[{i}].name", f"{tensor.name!r} is given twice")
        array = _tensor(raw_contents, i, tensor)
        if array.ndim != expected[tensor.name]:
            raise InvalidRequest(
                f"inputs[{i}].shape",
                f"{list(array.shape)} should have {expected[tensor.name]} dimensions",
            )
        arrays[tensor.name] = array
    if len(arrays) < len(expected):
        missing = sorted(set(expected) - set(arrays))
        raise InvalidRequest("inputs", f"missing {', '.join(missing)}")
    return arrays


def _infer_rows(arrays: dict[str, np.ndarray], manifest: Manifest) -> RowBatch:
    """The rows of an OIP request's tensors (`_infer_arrays`), their shapes and values checked."""
    spec = manifest.history
    features = arrays[manifest.features_input]
    n = features.shape[0]
    if n == 0:
        raise InvalidRequest("inputs", "batch is empty")
    if n > manifest.max_batch_size:
        raise InvalidRequest("inputs", f"{n} rows exceed the limit of {manifest.max_batch_size}")
    if features.shape[1] != manifest.n_features:
        raise InvalidRequest(
            f"{manifest.features_input}.shape",
            f"has {features.shape[1]} features, expected {manifest.n_features}",
        )
    # Every array here is C-contiguous already: a fresh buffer reshaped whole (`_tensor`), or
    # what `_finite` made of one.
    features = _finite(features, manifest.features_input, manifest)
    check_ranges(features, manifest, _escaped(manifest.features_input) + "[{row}][{feature!r}]")
    if spec is None:
        return RowBatch(features, None, None)
    history, mask = arrays[spec.input], arrays[spec.mask_input]
    if history.shape[0] != n or mask.shape[0] != n:
        raise InvalidRequest("inputs", "all inputs must have the same batch dimension")
    if history.shape[2] != len(spec.fields):
        raise InvalidRequest(
            f"{spec.input}.shape",
            f"rows have {history.shape[2]} fields, expected {len(spec.fields)}",
        )
    if history.shape[1] > spec.max_length:
        raise InvalidRequest(
            f"{spec.input}.shape", f"{history.shape[1]} rows exceed the limit of {spec.max_length}"
        )
    if history.shape[1] == 0:
        raise InvalidRequest(f"{spec.input}.shape", "needs at least one (possibly masked) row")
    if mask.shape[1] != history.shape[1]:
        raise InvalidRequest(f"{spec.mask_input}.shape", "must match the history length")
    history = _finite(history, spec.input, manifest)
    # Only 0 and 1: every nonzero value is a 1 (NaN, infinity and -1 are nonzero, and not 1).
    if np.count_nonzero(mask) != np.count_nonzero(mask == 1.0):
        raise InvalidRequest(spec.mask_input, "values must be 0 or 1")
    return RowBatch(features, history, mask)


def _escaped(name: str) -> str:
    return name.replace("{", "{{").replace("}", "}}")


def encode_infer_response(
    request: oip.ModelInferRequest, version: str, output: str, scores: np.ndarray
) -> oip.ModelInferResponse:
    column = np.ascontiguousarray(scores, dtype="<f4").reshape(-1, 1)
    response = oip.ModelInferResponse(
        model_name=request.model_name, model_version=version, id=request.id
    )
    response.outputs.add(name=output, datatype="FP32", shape=list(column.shape))
    response.raw_output_contents.append(column.tobytes())
    return response
