"""A small scoring model built with onnx.helper, its manifest, and representative inputs."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

N_FEATURES = 6
N_FIELDS = 3
HIDDEN = 16


def make_model(seed: int = 0, weight_noise: float = 0.0) -> onnx.ModelProto:
    """features [B,F], history [B,T,H], history_mask [B,T] -> score [B,1].

    Masked mean over history rows, two MatMul branches, ReLU, MatMul, Sigmoid. `weight_noise`
    perturbs every weight, which is how a test makes a deliberately bad variant.
    """
    rng = np.random.default_rng(seed)
    w_f = rng.normal(0, 0.6, (N_FEATURES, HIDDEN)).astype(np.float32)
    w_h = rng.normal(0, 0.6, (N_FIELDS, HIDDEN)).astype(np.float32)
    b_1 = rng.normal(0, 0.1, (HIDDEN,)).astype(np.float32)
    w_o = rng.normal(0, 0.6, (HIDDEN, 1)).astype(np.float32)
    b_o = np.array([-0.3], dtype=np.float32)
    if weight_noise:
        noise = np.random.default_rng(seed + 1000)
        w_f = w_f + noise.normal(0, weight_noise, w_f.shape).astype(np.float32)
        w_h = w_h + noise.normal(0, weight_noise, w_h.shape).astype(np.float32)
        w_o = w_o + noise.normal(0, weight_noise, w_o.shape).astype(np.float32)
    inits = [
        numpy_helper.from_array(w_f, "w_f"),
        numpy_helper.from_array(w_h, "w_h"),
        numpy_helper.from_array(b_1, "b_1"),
        numpy_helper.from_array(w_o, "w_o"),
        numpy_helper.from_array(b_o, "b_o"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
        numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
    ]
    nodes = [
        helper.make_node("Unsqueeze", ["history_mask", "axis2"], ["mask3"]),
        helper.make_node("Mul", ["history", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axis1"], ["hsum"], keepdims=0),
        helper.make_node("ReduceSum", ["history_mask", "axis1"], ["count"], keepdims=1),
        helper.make_node("Max", ["count", "one"], ["count1"]),
        helper.make_node("Div", ["hsum", "count1"], ["hmean"]),
        helper.make_node("MatMul", ["features", "w_f"], ["zf"]),
        helper.make_node("MatMul", ["hmean", "w_h"], ["zh"]),
        helper.make_node("Add", ["zf", "zh"], ["z"]),
        helper.make_node("Add", ["z", "b_1"], ["zb"]),
        helper.make_node("Relu", ["zb"], ["a"]),
        helper.make_node("MatMul", ["a", "w_o"], ["logit0"]),
        helper.make_node("Add", ["logit0", "b_o"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["score"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny-risk",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", N_FEATURES]),
            helper.make_tensor_value_info(
                "history", TensorProto.FLOAT, ["batch", "length", N_FIELDS]
            ),
            helper.make_tensor_value_info("history_mask", TensorProto.FLOAT, ["batch", "length"]),
        ],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def make_inputs(n: int, length: int = 12, seed: int = 1) -> dict[str, np.ndarray]:
    """Random rows; each row has its own number of valid history rows (mask prefix)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, size=n)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
    history = rng.normal(0, 1, (n, length, N_FIELDS)).astype(np.float32) * mask[..., None]
    return {
        "features": rng.normal(0, 1, (n, N_FEATURES)).astype(np.float32),
        "history": history,
        "history_mask": mask,
    }


def manifest_dict(**overrides: object) -> dict[str, object]:
    data: dict[str, object] = {
        "name": "tiny",
        "version": "1",
        "features": [f"f{i}" for i in range(N_FEATURES)],
        "history": {"fields": [f"h{i}" for i in range(N_FIELDS)], "max_length": 256},
        "thresholds": {"review": 0.5, "decline": 0.8},
        "profiles": {
            "fp32": [{"batch": [1, 16, 64], "history_length": [1, 16, 32]}],
            "fp16": [{"batch": [1, 16, 64], "history_length": [1, 16, 32]}],
            "int8": [{"batch": [1, 16, 64], "history_length": [1, 16, 32]}],
        },
        "calibration": "calibration.npz",
    }
    data.update(overrides)
    return data


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model folder with model.onnx, manifest.json and calibration.npz (no variants yet)."""
    folder = tmp_path / "tiny" / "1"
    folder.mkdir(parents=True)
    onnx.save(make_model(), folder / "model.onnx")
    (folder / "manifest.json").write_text(json.dumps(manifest_dict(), indent=2) + "\n")
    np.savez(folder / "calibration.npz", **make_inputs(256, seed=7))
    return folder


@pytest.fixture
def inputs_factory() -> Callable[..., dict[str, np.ndarray]]:
    return make_inputs


def _load_standin() -> types.ModuleType:
    path = Path(__file__).with_name("trt_standin.py")
    spec = importlib.util.spec_from_file_location("riskserve_trt_standin", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


standin = _load_standin()


@dataclass
class StandIn:
    trt: types.ModuleType
    memory: object


@pytest.fixture
def install_trt(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], StandIn]:
    """Put a stand-in `tensorrt` (of the given version) and CUDA runtime in sys.modules."""

    def install(version: str = "10.13.0") -> StandIn:
        trt = standin.make_tensorrt(version)
        memory = standin.CudaMemory()
        trt.cuda_memory = memory  # type: ignore[attr-defined]
        runtime = memory.module()
        bindings = types.ModuleType("cuda.bindings")
        bindings.runtime = runtime  # type: ignore[attr-defined]
        cuda = types.ModuleType("cuda")
        cuda.bindings = bindings  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        monkeypatch.setitem(sys.modules, "cuda", cuda)
        monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
        monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", runtime)
        return StandIn(trt, memory)

    return install


@pytest.fixture
def scores_concurrently(model_dir: Path) -> Callable[..., None]:
    """Scores each batch `times` over on a thread of its own, checking every result against
    ONNX Runtime on model_dir's model; fails with the first error any thread met."""
    from engines.onnxrt import OnnxRuntimeEngine

    reference = OnnxRuntimeEngine.from_path(model_dir / "model.onnx")

    def check(engine: object, batches: list[dict[str, np.ndarray]], times: int = 1) -> None:
        errors: list[BaseException] = []

        def work(batch: dict[str, np.ndarray]) -> None:
            try:
                for _ in range(times):
                    got = engine.infer(batch)["score"]  # type: ignore[attr-defined]
                    np.testing.assert_allclose(got, reference.infer(batch)["score"], rtol=1e-6)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(b,)) for b in batches]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0] if errors else None

    return check


@pytest.fixture
def install_trt_only(monkeypatch: pytest.MonkeyPatch) -> Callable[..., types.ModuleType]:
    """A stand-in `tensorrt` whose execution reads and writes `memory`; CUDA stays the real one."""

    def install(memory: object, version: str = "10.13.0") -> types.ModuleType:
        trt = standin.make_tensorrt(version)
        trt.cuda_memory = memory  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        return trt

    return install


@pytest.fixture(params=["10.13.0", "11.4.0"], ids=["trt10", "trt11"])
def trt(request: pytest.FixtureRequest, install_trt: Callable[[str], StandIn]) -> StandIn:
    """Each test using this runs against both TensorRT 10 and 11 behaviour."""
    return install_trt(request.param)


@pytest.fixture
def model_factory() -> Callable[..., onnx.ModelProto]:
    return make_model
