"""Reduced-precision variants of a model's FP32 ONNX: FP16 (I/O kept FP32) and INT8 Q/DQ.

FP16 uses onnxconverter-common's float16 converter with ``keep_io_types=True``: it is maintained
by the ONNX project, needs only onnx and numpy, and runs on any host. NVIDIA ModelOpt's AutoCast
is TensorRT 11's recommended path, but its ONNX extra pulls in onnxruntime-gpu, which must never
share an environment with the CPU onnxruntime this project uses.

INT8 uses ONNX Runtime's static quantizer in the form TensorRT accepts: explicit Q/DQ pairs,
symmetric (zero point 0) INT8 activations and per-channel INT8 weights, on MatMul/Gemm only
(quantizing the bias Add and Sigmoid too costs far more accuracy for no TensorRT gain).

    python -m engines.precision models/<name>/<version>
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from engines.manifest import load_manifest

__all__ = [
    "INT8_OP_TYPES",
    "NpzCalibrationReader",
    "convert_fp16",
    "make_variants",
    "quantize_int8",
    "set_manifest_variants",
]

log = logging.getLogger(__name__)

INT8_OP_TYPES = ("MatMul", "Gemm")
FP16_FILE = "model.fp16.onnx"
INT8_FILE = "model.int8.onnx"


def _name_nodes(model: onnx.ModelProto) -> None:
    # The converter names its I/O casts after the consuming node; unnamed nodes would collide.
    taken = {n.name for n in model.graph.node if n.name}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{index}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)


def convert_fp16(src: Path, dst: Path) -> Path:
    """Write an FP16 copy of `src` whose graph inputs and outputs stay FP32."""
    from onnxconverter_common import float16

    model = onnx.load(str(src))
    _name_nodes(model)
    with warnings.catch_warnings(record=True) as caught:
        # The converter warns for each weight it clamps to the FP16 range; keep those as logs.
        warnings.simplefilter("always")
        converted = float16.convert_float_to_float16(model, keep_io_types=True)
    for item in caught:
        log.info("fp16 conversion of %s: %s", src.name, item.message)
    onnx.checker.check_model(converted)
    onnx.save(converted, str(dst))
    return dst


def _base_reader() -> type:
    from onnxruntime.quantization import CalibrationDataReader

    return CalibrationDataReader  # type: ignore[no-any-return]


class NpzCalibrationReader:
    """Feeds calibration batches from arrays (or an npz file) keyed by ONNX input name.

    Built on first use as a subclass of ONNX Runtime's `CalibrationDataReader` (see `reader()`),
    so this module imports without onnxruntime.quantization loaded.
    """

    def __init__(
        self,
        source: Path | Mapping[str, np.ndarray],
        input_names: Sequence[str],
        batch_size: int = 64,
    ) -> None:
        if isinstance(source, Path | str):
            with np.load(source) as npz:
                arrays = {name: np.asarray(npz[name], dtype=np.float32) for name in input_names}
        else:
            arrays = {name: np.asarray(source[name], dtype=np.float32) for name in input_names}
        sizes = {len(a) for a in arrays.values()}
        if len(sizes) != 1:
            raise ValueError(f"calibration arrays differ in rows: {sorted(sizes)}")
        self.arrays = arrays
        self.rows = sizes.pop()
        self.batch_size = batch_size

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, self.rows, self.batch_size):
            yield {n: a[start : start + self.batch_size] for n, a in self.arrays.items()}

    def reader(self) -> Any:
        """A fresh `CalibrationDataReader` over the batches."""
        base = _base_reader()
        batches = self.batches()

        class _Reader(base):  # type: ignore[misc, valid-type]
            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(batches, None)

        return _Reader()


def quantize_int8(
    src: Path,
    dst: Path,
    calibration: NpzCalibrationReader,
    op_types: Sequence[str] = INT8_OP_TYPES,
) -> Path:
    """Write a symmetric INT8 Q/DQ copy of `src`, calibrated on `calibration`'s batches."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        # Shape inference first, as ONNX Runtime's quantizer advises; no graph rewrites.
        quant_pre_process(str(src), str(prepared), skip_optimization=True, skip_symbolic_shape=True)
        quantize_static(
            str(prepared),
            str(dst),
            calibration.reader(),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(op_types),
            per_channel=True,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            extra_options={
                "ActivationSymmetric": True,
                "WeightSymmetric": True,
                # A MatMul output feeds the bias Add in float; a Q/DQ pair there only costs.
                "OpTypesToExcludeOutputQuantization": list(op_types),
            },
        )
    return dst


def zero_points(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Every QuantizeLinear/DequantizeLinear zero point in the graph, by initializer name."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    found: dict[str, np.ndarray] = {}
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2:
            found[node.input[2]] = inits[node.input[2]]
    return found


def set_manifest_variants(model_dir: Path, variants: Mapping[str, str]) -> None:
    """Rewrite only the manifest's ``variants`` key, keeping every other key as written."""
    path = model_dir / "manifest.json"
    data = json.loads(path.read_text())
    data["variants"] = dict(variants)
    path.write_text(json.dumps(data, indent=2) + "\n")


def make_variants(model_dir: Path, *, batch_size: int = 64) -> dict[str, str]:
    """Produce model.fp16.onnx and model.int8.onnx beside model.onnx; update the manifest."""
    manifest = load_manifest(model_dir)
    if manifest.calibration is None:
        raise ValueError(f"{model_dir}/manifest.json names no calibration file")
    src = model_dir / "model.onnx"
    names = [i.name for i in onnx.load(str(src), load_external_data=False).graph.input]
    reader = NpzCalibrationReader(model_dir / manifest.calibration, names, batch_size)
    convert_fp16(src, model_dir / FP16_FILE)
    quantize_int8(src, model_dir / INT8_FILE, reader)
    variants = {"fp16": FP16_FILE, "int8": INT8_FILE}
    set_manifest_variants(model_dir, variants)
    return variants


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.precision", description=__doc__)
    parser.add_argument("model_dir", type=Path, help="models/<name>/<version> folder")
    parser.add_argument("--batch-size", type=int, default=64, help="calibration batch rows")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    variants = make_variants(args.model_dir, batch_size=args.batch_size)
    for precision, file in variants.items():
        print(f"{precision}: {args.model_dir / file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
