from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engines.base import EngineUnavailable, ShapeMismatch
from engines.manifest import load_manifest
from engines.onnxrt import OnnxRuntimeEngine, SessionFromPath


def test_cpu_engine_scores_like_a_plain_session(model_dir: Path, inputs_factory) -> None:
    engine = OnnxRuntimeEngine.from_model_dir(model_dir, load_manifest(model_dir))
    inputs = inputs_factory(32)
    plain = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    expected = plain.run(["score"], inputs)[0]
    np.testing.assert_array_equal(engine.infer(inputs)["score"], expected)
    assert engine.name == "onnxruntime-cpu"
    assert engine.kind == "onnxruntime"
    assert engine.providers == ("CPUExecutionProvider",)


def test_one_unbounded_profile_from_the_onnx_dims(model_dir: Path) -> None:
    engine = OnnxRuntimeEngine.from_path(model_dir / "model.onnx")
    (profile,) = engine.profiles
    history = next(s for s in profile.inputs if s.name == "history")
    assert [d.max_value for d in history.dims] == [None, None, 3]
    assert engine.max_batch_size is None
    assert history.fits((500, 1000, 3))


def test_wrong_field_count_names_the_tensor(model_dir: Path, inputs_factory) -> None:
    engine = OnnxRuntimeEngine.from_path(model_dir / "model.onnx")
    inputs = inputs_factory(4)
    inputs["history"] = np.zeros((4, 12, 5), np.float32)
    with pytest.raises(ShapeMismatch) as info:
        engine.infer(inputs)
    assert info.value.tensor == "history"
    assert info.value.dims == (4, 12, 5)


def test_onnxruntime_invalid_argument_maps_to_shape_mismatch(
    model_dir: Path, inputs_factory
) -> None:
    engine = OnnxRuntimeEngine.from_path(model_dir / "model.onnx")
    inputs = inputs_factory(4)
    inputs["features"] = np.zeros((4, 9), np.float32)
    # Past the profile check, ONNX Runtime's own InvalidArgument must map the same way.
    with pytest.raises(ShapeMismatch) as info:
        engine._infer(inputs, engine.profiles[0])
    assert info.value.tensor == "features"
    assert isinstance(info.value.__cause__, Exception)
    assert type(info.value.__cause__).__name__ == "InvalidArgument"


def test_precision_suffix_in_the_name(model_dir: Path) -> None:
    engine = OnnxRuntimeEngine.from_path(model_dir / "model.onnx", precision="int8")
    assert engine.name == "onnxruntime-cpu-int8"


def test_requiring_cuda_on_a_cpu_build_is_refused(model_dir: Path) -> None:
    loader = SessionFromPath(
        model_dir / "model.onnx",
        providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
        require_providers=True,
    )
    with pytest.raises(EngineUnavailable, match="CUDAExecutionProvider"):
        loader()


def test_broken_file_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    with pytest.raises(EngineUnavailable):
        SessionFromPath(tmp_path / "bad.onnx")()


def test_session_options_are_set(model_dir: Path) -> None:
    session = SessionFromPath(model_dir / "model.onnx", intra_op_threads=2)()
    options = session.get_session_options()
    assert options.intra_op_num_threads == 2
    assert options.inter_op_num_threads == 1
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def test_concurrent_runs_agree(model_dir: Path, inputs_factory) -> None:
    engine = OnnxRuntimeEngine.from_path(model_dir / "model.onnx", max_concurrency=4)
    inputs = inputs_factory(16)
    expected = engine.infer(inputs)["score"]
    results: list[np.ndarray] = []
    threads = [
        threading.Thread(target=lambda: results.append(engine.infer(inputs)["score"]))
        for _ in range(engine.max_concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for r in results:
        np.testing.assert_array_equal(r, expected)


def test_model_without_history_serves(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["features", "axes"], ["score"], keepdims=1)],
        "plain",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=[helper.make_tensor("axes", TensorProto.INT64, [1], [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, tmp_path / "m.onnx")
    engine = OnnxRuntimeEngine.from_path(tmp_path / "m.onnx")
    out = engine.infer({"features": np.ones((3, 4), np.float32)})["score"]
    np.testing.assert_array_equal(out, np.full((3, 1), 4.0, np.float32))
