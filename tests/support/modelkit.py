"""Small ONNX models written with onnx.helper, so tests can serve models other than the demo."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from engines.precision import make_variants
from engines.validation import validate_model, write_report
from riskscoring.v1 import risk_scoring_pb2 as pb


def _save(model: onnx.ModelProto, folder: Path, manifest: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    onnx.checker.check_model(model)
    onnx.save(model, folder / "model.onnx")
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return folder


def write_tabular_model(
    root: Path, name: str = "credit-lite", version: str = "1", n_features: int = 5, seed: int = 0
) -> Path:
    """Logistic regression over `n_features` inputs, no history: score = sigmoid(x.w + b)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(n_features, 1)).astype(np.float32)
    b = np.array([0.1], dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["logit"]),
            helper.make_node("Sigmoid", ["logit"], ["score"]),
        ],
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_features])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    manifest = {
        "name": name,
        "version": version,
        "description": "test logistic regression",
        "features_input": "x",
        "features": [f"f{i}" for i in range(n_features)],
        "output": "score",
        "nan_policy": "zero",
        "thresholds": {"review": 0.5, "decline": 0.9},
        "max_batch_size": 32,
    }
    return _save(model, root / name / version, manifest)


def add_validated_variants(version_dir: Path) -> None:
    """FP16 and INT8 variants of a `write_tabular_model` folder's `model.onnx`, checked against
    it as `riskserve validate` does, under a tolerance both meet; the report saved beside."""
    rows = np.random.default_rng(11).normal(size=(512, 5)).astype(np.float32)
    manifest = json.loads((version_dir / "manifest.json").read_text())
    manifest["calibration"] = "calibration.npz"
    manifest["tolerance"] = {"max_abs_error": 1.0, "auc_drop": 1.0, "flip_rate": 1.0}
    (version_dir / "manifest.json").write_text(json.dumps(manifest))
    np.savez(version_dir / "calibration.npz", x=rows)
    make_variants(version_dir)
    session = ort.InferenceSession(
        str(version_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    scores = session.run(["score"], {"x": rows})[0].ravel()
    labels = np.random.default_rng(12).random(len(rows)) < scores
    write_report(version_dir, validate_model(version_dir, {"x": rows}, labels))


def write_sequence_model(
    root: Path,
    name: str = "seq-mini",
    version: str = "1",
    n_features: int = 4,
    n_fields: int = 3,
    max_length: int = 16,
    seed: int = 1,
    join: str = "add",
    broadcast: bool = False,
) -> Path:
    """sigmoid(x.w + mean over valid rows of (h.v)): the demo's inputs in miniature.

    `join` "add" adds the two terms (numpy broadcasting: a history batch of one serves any
    number of feature rows); "concat" concatenates them and sums, the same score, but a history
    batch must equal the features' batch. `broadcast` declares `history.broadcast`."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(n_features, 1)).astype(np.float32)
    v = rng.normal(size=(n_fields, 1)).astype(np.float32)
    one = np.array([1.0], dtype=np.float32)
    nodes = [
        helper.make_node("MatMul", ["features", "w"], ["xw"]),
        helper.make_node("MatMul", ["history", "v"], ["hv3"]),  # (B, T, 1)
        helper.make_node("Squeeze", ["hv3", "axis2"], ["hv"]),  # (B, T)
        helper.make_node("Mul", ["hv", "history_mask"], ["hv_masked"]),
        helper.make_node("ReduceSum", ["hv_masked", "axis1"], ["hsum"], keepdims=1),
        helper.make_node("ReduceSum", ["history_mask", "axis1"], ["count"], keepdims=1),
        helper.make_node("Max", ["count", "one"], ["denominator"]),
        helper.make_node("Div", ["hsum", "denominator"], ["hmean"]),
    ]
    if join == "add":
        nodes.append(helper.make_node("Add", ["xw", "hmean"], ["logit"]))
    else:
        nodes += [
            helper.make_node("Concat", ["xw", "hmean"], ["terms"], axis=1),
            helper.make_node("ReduceSum", ["terms", "axis1"], ["logit"], keepdims=1),
        ]
    nodes.append(helper.make_node("Sigmoid", ["logit"], ["score"]))
    graph = helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", n_features]),
            helper.make_tensor_value_info("history", TensorProto.FLOAT, ["batch", "t", n_fields]),
            helper.make_tensor_value_info("history_mask", TensorProto.FLOAT, ["batch", "t"]),
        ],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=[
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(v, "v"),
            numpy_helper.from_array(one, "one"),
            numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    manifest = {
        "name": name,
        "version": version,
        "features": [f"x{i}" for i in range(n_features)],
        "history": {
            "fields": [f"h{i}" for i in range(n_fields)],
            "max_length": max_length,
            "broadcast": broadcast,
        },
        "output": "score",
        "thresholds": {"review": 0.6, "decline": 0.85},
        "max_batch_size": 64,
    }
    return _save(model, root / name / version, manifest)


def sequence_request(i: int, entities: int, **fields: object) -> pb.ScoreRequest:
    """A Score request for `write_sequence_model`'s default shape (features x0..x3, history rows
    of 3 values), drawn from seed `i`: entity `acct-{i % entities}`, 1 to 5 history rows;
    `fields` sets further ScoreRequest fields."""
    rng = np.random.default_rng(i)
    return pb.ScoreRequest(
        request_id=f"q{i}",
        entity_id=f"acct-{i % entities}",
        features={f"x{j}": float(v) for j, v in enumerate(rng.normal(size=4))},
        history=[pb.HistoryRow(values=rng.normal(size=3).tolist()) for _ in range(1 + i % 5)],
        **fields,
    )
