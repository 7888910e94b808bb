"""demo.share_history: the Expand that lets one history serve many feature rows."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from liveserver import REPO
from onnx import TensorProto, helper, numpy_helper

from demo.share_history import HEAD_CONCAT, HISTORY_BATCH, share_history


def _exported_shape() -> onnx.ModelProto:
    """The demo's head in miniature, as the exporter writes it: a tabular term and three
    history terms (mean, max, a count) joined by a Concat named like the exporter's."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    head = rng.normal(size=(2 + 3 * 2, 1)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["features", "w"], ["tabular"]),
        helper.make_node("ReduceMean", ["history", "axis1"], ["mean"], keepdims=0),
        helper.make_node("ReduceMax", ["history", "axis1"], ["peak"], keepdims=0),
        helper.make_node("Mul", ["mean", "peak"], ["count"]),
        helper.make_node(
            "Concat", ["tabular", "mean", "peak", "count"], ["joined"], name=HEAD_CONCAT, axis=1
        ),
        helper.make_node("MatMul", ["joined", "head"], ["score"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mini",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("history", TensorProto.FLOAT, ["batch", "t", 2]),
        ],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=[
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(head, "head"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0]


def test_one_history_scores_every_row_as_that_history_repeated():
    rng = np.random.default_rng(1)
    features = rng.normal(size=(4, 3)).astype(np.float32)
    history = rng.normal(size=(1, 5, 2)).astype(np.float32)
    repeated = {"features": features, "history": np.repeat(history, 4, axis=0)}
    before = _run(_exported_shape(), repeated)
    edited = share_history(_exported_shape(), history_inputs=("history",))
    assert edited.graph.input[1].type.tensor_type.shape.dim[0].dim_param == HISTORY_BATCH
    np.testing.assert_array_equal(_run(edited, repeated), before)  # equal batches: unchanged
    shared = _run(edited, {"features": features, "history": history})
    np.testing.assert_allclose(shared, before, rtol=1e-6)


def test_editing_twice_changes_nothing_and_a_foreign_graph_is_refused():
    edited = share_history(_exported_shape())
    again = share_history(onnx.ModelProto.FromString(edited.SerializeToString()))
    assert again.SerializeToString() == edited.SerializeToString()
    demo = onnx.load(str(REPO / "models" / "fraud-demo" / "1" / "model.onnx"))
    assert share_history(demo) is demo  # the committed model has it already
    foreign = _exported_shape()
    foreign.graph.node[4].name = "/other/Concat"
    with pytest.raises(ValueError, match=r"not a graph exported by demo\.train"):
        share_history(foreign)
