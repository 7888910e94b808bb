"""Where a model's risk score is among its outputs: resolved once when a version loads.

A neural network usually ends in one probability per row (``[N]`` or ``[N, 1]``). The standard
exports of classifiers (skl2onnx, onnxmltools for LightGBM and XGBoost, CatBoost's own exporter)
end in a ``label`` output and a class-probability output: a ``[N, K]`` tensor, or with the
converters' default ``zipmap`` a sequence of one ``{class: probability}`` map per row. The
manifest's ``output`` names the probability output and, where it has several classes,
``risk_class`` names the class whose probability is the risk score: a label the model declares
(its classifier or ZipMap node's ``classlabels_*`` attribute), else a column index.

Nothing here guesses: a layout that could be read two ways is refused with one message naming
the output, its type or shape, and the manifest field to set. A ZipMap output is read through
the tensor the ZipMap node maps (its input, a ``[N, K]`` float tensor whose columns follow the
node's labels): ONNX Runtime sessions of such a model fetch that tensor as an extra output, so a
batch costs no Python object per row and the score is the same number the map holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from engines.manifest import Manifest

__all__ = [
    "ML_DOMAIN",
    "OutputLayoutError",
    "ScoreOutput",
    "onnx_ml_operators",
    "resolve_score_output",
]

ML_DOMAIN = "ai.onnx.ml"
"""The ONNX domain of the classic-ML operators (tree ensembles, linear classifiers, ZipMap)."""

_LABEL_ATTRIBUTES = ("classlabels_int64s", "classlabels_ints", "classlabels_strings")
_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: "float",
    onnx.TensorProto.DOUBLE: "double",
    onnx.TensorProto.FLOAT16: "float16",
}
# The name the score goes by where it is one column of a multi-class output (OIP's response).
_SCORE_NAME = "score"

Label = int | str


class OutputLayoutError(ValueError):
    """The manifest's output declaration does not fit the model's real outputs."""


@dataclass(frozen=True, slots=True)
class ScoreOutput:
    """How to read one version's risk score from what its engines return.

    `tensor` is what every engine fetches: the manifest's output, or for a ZipMap output the
    ``[N, K]`` tensor the map is made from (`added` then: a tensor ONNX Runtime sessions add to
    the graph's outputs). `column` is the risk class's column of a ``[N, K]`` tensor; None where
    the tensor holds one score per row.
    """

    output: str
    tensor: str
    column: int | None = None
    classes: tuple[Label, ...] | None = None
    risk_class: Label | None = None
    added: bool = False

    @property
    def served_name(self) -> str:
        """The score's tensor name in OIP responses and metadata: the output's own name where
        it is the score, else ``score`` (one column of a class-probability output)."""
        return self.output if self.column is None else _SCORE_NAME

    @property
    def extra_outputs(self) -> tuple[str, ...]:
        """Tensors an ONNX Runtime session must add to the graph's outputs."""
        return (self.tensor,) if self.added else ()

    def describe(self) -> str:
        """One phrase for logs and errors, e.g. ``column 1 (class 1) of 'probabilities'``."""
        if self.column is None:
            return f"{self.output!r}"
        label = "" if self.classes is None else f" (class {self.risk_class!r})"
        via = f" via {self.tensor!r}" if self.tensor != self.output else ""
        return f"column {self.column}{label} of {self.output!r}{via}"

    def scores(self, outputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The risk score of every row, as float32 of shape (N,)."""
        value = outputs[self.tensor]
        if self.column is None:
            return np.asarray(value, dtype=np.float32).reshape(-1)
        return np.asarray(value[:, self.column], dtype=np.float32)

    def check(self, outputs: Mapping[str, np.ndarray], rows: int) -> np.ndarray:
        """Check what an engine really returned for `rows` rows against this layout (the probe
        row at load); returns the scores. Raises `OutputLayoutError` naming what differs."""
        if self.tensor not in outputs:
            raise OutputLayoutError(f"output {self.tensor!r}: the engine did not return it")
        value = np.asarray(outputs[self.tensor])
        shape = list(value.shape)
        if value.dtype.kind != "f":
            raise OutputLayoutError(
                f"output {self.tensor!r} holds {value.dtype} values, not probabilities; "
                "set the manifest's `output` to the model's probability output"
            )
        if self.column is None:
            if shape not in ([rows], [rows, 1]):
                raise OutputLayoutError(
                    f"output {self.output!r} returned shape {shape} for {rows} rows: several "
                    "values a row need the manifest's `risk_class` to say which is the score"
                )
        else:
            width = len(self.classes) if self.classes is not None else self.column + 1
            if len(shape) != 2 or shape[0] != rows or shape[1] < width:
                raise OutputLayoutError(
                    f"output {self.tensor!r} returned shape {shape} for {rows} rows, where "
                    f"{self.describe()} needs [{rows}, {width}]"
                )
        scores = self.scores(outputs)
        if not np.isfinite(scores).all():
            raise OutputLayoutError(f"{self.describe()} is not finite on the probe row")
        return scores


def onnx_ml_operators(model: onnx.ModelProto) -> tuple[str, ...]:
    """The classic-ML operators (domain ``ai.onnx.ml``) in the graph, each once, sorted:
    TensorRT has no layers for them, so only ONNX Runtime runs such a model."""
    return tuple(sorted({n.op_type for n in model.graph.node if n.domain == ML_DOMAIN}))


def resolve_score_output(model: onnx.ModelProto | Path, manifest: Manifest) -> ScoreOutput:
    """Match the manifest's `output` and `risk_class` against the model's graph.

    Raises `OutputLayoutError` where the output is missing, holds labels rather than
    probabilities, or has several classes with no `risk_class` (or one that names no class).
    """
    if isinstance(model, Path):
        model = onnx.load(str(model), load_external_data=False)
    graph = model.graph
    outputs = {o.name: o for o in graph.output}
    name = manifest.output
    if name not in outputs:
        raise OutputLayoutError(
            f"manifest `output`: {name!r} is not an output of the model; it has "
            f"{_list_outputs(graph.output)}"
        )
    kind = outputs[name].type.WhichOneof("value")
    if kind == "sequence_type":
        return _zipmap_output(graph, name, manifest.risk_class)
    if kind != "tensor_type":
        raise OutputLayoutError(
            f"output {name!r} is a {kind}, not a tensor of probabilities; set the manifest's "
            "`output` to the model's probability output"
        )
    tensor = outputs[name].type.tensor_type
    if tensor.elem_type not in _FLOAT_TYPES:
        raise OutputLayoutError(
            f"output {name!r} is a tensor of {onnx.TensorProto.DataType.Name(tensor.elem_type)}"
            f" (class labels, not probabilities); set the manifest's `output` to the model's "
            f"probability output ({_list_outputs(graph.output)})"
        )
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    shape = "[" + ", ".join("N" if d is None else str(d) for d in dims) + "]"
    width = dims[1] if len(dims) == 2 else None
    if len(dims) == 1 or width == 1:
        if manifest.risk_class is not None:
            raise OutputLayoutError(
                f"manifest `risk_class` is set, but output {name!r} {shape} holds one score a "
                "row; remove `risk_class`"
            )
        return ScoreOutput(output=name, tensor=name)
    if len(dims) != 2:
        raise OutputLayoutError(
            f"output {name!r} has shape {shape}; a score output is [N], [N, 1] or [N, K] "
            "class probabilities"
        )
    classes = _declared_classes(graph, width)
    return _column_output(name, name, shape, classes, width, manifest.risk_class, added=False)


def _zipmap_output(graph: onnx.GraphProto, name: str, risk_class: Label | None) -> ScoreOutput:
    zipmaps = [n for n in graph.node if n.op_type == "ZipMap" and name in n.output]
    if not zipmaps:
        raise OutputLayoutError(
            f"output {name!r} is a sequence that no ZipMap node makes; export the classifier "
            "with a tensor output (skl2onnx: options={'zipmap': False}; onnxmltools: zipmap=False)"
        )
    node = zipmaps[0]
    classes = _labels(node)
    assert classes is not None  # ZipMap requires one of its label attributes
    produced = {o.name for o in graph.output}
    return _column_output(
        name,
        node.input[0],
        f"a ZipMap of {len(classes)} classes {list(classes)}",
        classes,
        len(classes),
        risk_class,
        added=node.input[0] not in produced,
    )


def _column_output(
    name: str,
    tensor: str,
    shape: str,
    classes: tuple[Label, ...] | None,
    width: int | None,
    risk_class: Label | None,
    *,
    added: bool,
) -> ScoreOutput:
    declared = f"classes {list(classes)}" if classes is not None else "no class labels"
    if risk_class is None:
        raise OutputLayoutError(
            f"output {name!r} is {shape} ({declared}): set the manifest's `risk_class` to the "
            "class whose probability is the risk score"
        )
    if classes is not None:
        if risk_class not in classes:
            raise OutputLayoutError(
                f"manifest `risk_class` {risk_class!r} is not a class of output {name!r} "
                f"({declared})"
            )
        column = classes.index(risk_class)
    elif isinstance(risk_class, int) and risk_class >= 0 and (width is None or risk_class < width):
        column = risk_class
    else:
        raise OutputLayoutError(
            f"manifest `risk_class` {risk_class!r}: output {name!r} is {shape} and declares no "
            "class labels, so `risk_class` must be a column index"
            + ("" if width is None else f" below {width}")
        )
    return ScoreOutput(
        output=name, tensor=tensor, column=column, classes=classes, risk_class=risk_class,
        added=added,
    )  # fmt: skip


def _labels(node: onnx.NodeProto) -> tuple[Label, ...] | None:
    for attribute in node.attribute:
        if attribute.name in _LABEL_ATTRIBUTES:
            if attribute.strings:
                return tuple(s.decode() for s in attribute.strings)
            return tuple(int(i) for i in attribute.ints)
    return None


def _declared_classes(graph: onnx.GraphProto, width: int | None) -> tuple[Label, ...] | None:
    """The class labels the graph's classifier and ZipMap nodes declare, where they all agree
    (and match the output's width); None where there are none, or they disagree."""
    found = {
        labels
        for node in graph.node
        if node.domain == ML_DOMAIN and (labels := _labels(node)) is not None
    }
    if len(found) != 1:
        return None
    labels = found.pop()
    return labels if width is None or len(labels) == width else None


def _list_outputs(outputs: Sequence[onnx.ValueInfoProto]) -> str:
    def describe(info: onnx.ValueInfoProto) -> str:
        kind = info.type.WhichOneof("value")
        if kind == "tensor_type":
            elem = onnx.TensorProto.DataType.Name(info.type.tensor_type.elem_type).lower()
            return f"{info.name!r} ({elem} tensor)"
        return f"{info.name!r} ({kind.replace('_type', '') if kind else 'untyped'})"

    return ", ".join(describe(o) for o in outputs)
