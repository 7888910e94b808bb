"""The benchmark's model: where its ONNX file is, what it expects, and a stand-in when absent.

Every server in the comparison serves the same ONNX file and receives the same three tensors:
``features`` (batch, n_features), ``history`` (batch, history_len, n_fields) and
``history_mask`` (batch, history_len), all FP32, and answers ``score`` (batch, 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "DEMO_MODEL_PATH",
    "REPO_ROOT",
    "STANDIN_MODELS_DIR",
    "STANDIN_MODEL_PATH",
    "ModelIO",
    "build_standin_model",
    "make_request_arrays",
    "read_model_io",
    "resolve_model_path",
    "write_standin_models_dir",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL_PATH = REPO_ROOT / "models" / "fraud-demo" / "1" / "model.onnx"
STANDIN_MODEL_PATH = REPO_ROOT / "bench" / ".peers" / "standin" / "model.onnx"
STANDIN_MODELS_DIR = REPO_ROOT / "bench" / ".peers" / "standin-models"


@dataclass(frozen=True)
class ModelIO:
    """Names and fixed sizes of the model's tensors (dynamic axes left out)."""

    n_features: int
    n_history_fields: int
    features_input: str = "features"
    history_input: str = "history"
    mask_input: str = "history_mask"
    output: str = "score"


def read_model_io(onnx_path: Path) -> ModelIO:
    """Reads input names and the fixed feature and history-field widths from an ONNX file."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    dims = {
        inp.name: [
            d.dim_value if d.HasField("dim_value") else -1 for d in inp.type.tensor_type.shape.dim
        ]
        for inp in model.graph.input
    }
    return ModelIO(
        n_features=dims["features"][-1],
        n_history_fields=dims["history"][-1],
        output=model.graph.output[0].name,
    )


def build_standin_model(
    path: Path, n_features: int = 30, n_fields: int = 8, hidden: int = 64
) -> Path:
    """Writes an MLP over features plus masked-mean-pooled history with the demo model's I/O."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name
        )

    inits = [
        weight("w_hist", n_fields, hidden),
        weight("w_feat", n_features, hidden),
        weight("w_pool", hidden, hidden),
        weight("w_out", hidden, 1),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "axis_last"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis_time"),
        numpy_helper.from_array(np.array([1.0], dtype=np.float32), "one"),
    ]
    nodes = [
        helper.make_node("MatMul", ["history", "w_hist"], ["h_proj"]),
        helper.make_node("Relu", ["h_proj"], ["h_act"]),
        helper.make_node("Unsqueeze", ["history_mask", "axis_last"], ["mask3"]),
        helper.make_node("Mul", ["h_act", "mask3"], ["h_masked"]),
        helper.make_node("ReduceSum", ["h_masked", "axis_time"], ["h_sum"], keepdims=0),
        helper.make_node("ReduceSum", ["history_mask", "axis_time"], ["m_sum"], keepdims=1),
        helper.make_node("Max", ["m_sum", "one"], ["m_den"]),
        helper.make_node("Div", ["h_sum", "m_den"], ["h_mean"]),
        helper.make_node("MatMul", ["h_mean", "w_pool"], ["h_pool"]),
        helper.make_node("MatMul", ["features", "w_feat"], ["f_proj"]),
        helper.make_node("Add", ["f_proj", "h_pool"], ["z"]),
        helper.make_node("Relu", ["z"], ["z_act"]),
        helper.make_node("MatMul", ["z_act", "w_out"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["score"]),
    ]
    graph = helper.make_graph(
        nodes,
        "fraud_standin",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", n_features]),
            helper.make_tensor_value_info(
                "history", TensorProto.FLOAT, ["batch", "time", n_fields]
            ),
            helper.make_tensor_value_info("history_mask", TensorProto.FLOAT, ["batch", "time"]),
        ],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def resolve_model_path(explicit: Path | None = None) -> Path:
    """The ONNX file to serve: an explicit one, else the demo model, else the stand-in (built)."""
    if explicit is not None:
        return explicit
    if DEMO_MODEL_PATH.exists():
        return DEMO_MODEL_PATH
    if not STANDIN_MODEL_PATH.exists():
        build_standin_model(STANDIN_MODEL_PATH)
    return STANDIN_MODEL_PATH


def write_standin_models_dir(onnx_path: Path, root: Path = STANDIN_MODELS_DIR) -> Path:
    """A riskserve models folder ``root/fraud-demo/1/`` serving `onnx_path` with a manifest."""
    import json
    import shutil

    io = read_model_io(onnx_path)
    version_dir = root / "fraud-demo" / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(onnx_path, version_dir / "model.onnx")
    manifest = {
        "name": "fraud-demo",
        "version": "1",
        "description": "benchmark stand-in with the demo model's inputs and output",
        "features": [f"f{i:02d}" for i in range(io.n_features)],
        "history": {
            "fields": [f"h{i}" for i in range(io.n_history_fields)],
            "max_length": 256,
        },
        "output": io.output,
        "thresholds": {"review": 0.5, "decline": 0.9},
    }
    (version_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return root


def make_request_arrays(
    io: ModelIO,
    history_len: int,
    batch: int = 1,
    seed: int = 0,
    calibration: Path | None = None,
) -> dict[str, np.ndarray]:
    """One request's inputs with exactly `history_len` valid history rows.

    Taken from a calibration file (``calibration.npz`` beside the demo model: realistic values,
    so the score means something; a shorter real history is repeated to the length); random
    where there is none.
    """
    rng = np.random.default_rng(seed)
    if calibration is None and (DEMO_MODEL_PATH.parent / "calibration.npz").exists():
        calibration = DEMO_MODEL_PATH.parent / "calibration.npz"
    if calibration is not None and calibration.exists():
        arrays = _from_calibration(io, calibration, history_len, batch)
        if arrays is not None:
            return arrays
    return {
        io.features_input: rng.standard_normal((batch, io.n_features), dtype=np.float32),
        io.history_input: rng.standard_normal(
            (batch, history_len, io.n_history_fields), dtype=np.float32
        ),
        io.mask_input: np.ones((batch, history_len), dtype=np.float32),
    }


def _from_calibration(
    io: ModelIO, path: Path, history_len: int, batch: int
) -> dict[str, np.ndarray] | None:
    data = np.load(path)
    names = (io.features_input, io.history_input, io.mask_input)
    if any(name not in data for name in names):
        return None
    features, history, mask = (data[name] for name in names)
    if features.shape[1] != io.n_features or history.shape[2] != io.n_history_fields:
        return None
    # The rows with the most history; a row with fewer than `history_len` real rows repeats
    # them (the values stay realistic: random ones fall outside the model's feature ranges).
    lengths = mask.sum(axis=1)
    rows = np.flatnonzero(lengths >= history_len)[:batch]
    if rows.size < batch:
        rows = np.argsort(-lengths, kind="stable")[:batch]
    if rows.size < batch or lengths[rows].min() == 0:
        return None
    picked = [np.resize(history[r][mask[r] > 0], (history_len, history.shape[2])) for r in rows]
    return {
        io.features_input: features[rows].astype(np.float32),
        io.history_input: np.stack(picked).astype(np.float32),
        io.mask_input: np.ones((batch, history_len), dtype=np.float32),
    }
