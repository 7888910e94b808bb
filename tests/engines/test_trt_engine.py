"""`TensorRTEngine` against the stand-in tensorrt and CUDA runtime (TensorRT 10 and 11)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engines.base import (
    DimRange,
    EngineFailure,
    EngineUnavailable,
    Profile,
    ShapeMismatch,
    TensorSpec,
)
from engines.onnxrt import OnnxRuntimeEngine
from engines.trt import PlanStore, TensorRTEngine, build_engines
from engines.trt.cuda import CudaRuntime


@pytest.fixture
def plan(trt, model_dir: Path) -> bytes:
    (path,) = build_engines(model_dir, ["fp32"], contexts=2)
    return path.read_bytes()


def test_scores_match_onnxruntime(plan: bytes, model_dir: Path, inputs_factory) -> None:
    engine = TensorRTEngine(plan, precision="fp32")
    inputs = inputs_factory(20, length=12)
    expected = OnnxRuntimeEngine.from_path(model_dir / "model.onnx").infer(inputs)["score"]
    np.testing.assert_allclose(engine.infer(inputs)["score"], expected, rtol=1e-6)
    assert engine.name == "tensorrt-fp32"
    assert engine.kind == "tensorrt"


def test_profiles_come_from_the_plan(plan: bytes) -> None:
    engine = TensorRTEngine(plan, precision="fp32")
    assert len(engine.profiles) == 2
    assert engine.max_concurrency == 2
    history = next(s for s in engine.profiles[1].inputs if s.name == "history")
    assert history.dims == (DimRange(1, 16, 64), DimRange(1, 16, 32), DimRange(3, 3, 3))
    assert engine.max_batch_size == 64


def test_buffers_are_sized_for_the_profile_max_and_freed(trt, plan: bytes) -> None:
    before = set(trt.memory.blocks)
    engine = TensorRTEngine(plan, precision="fp32")
    sizes = sorted(size for p, (_, size, _dev) in trt.memory.blocks.items() if p not in before)
    per_context = [64 * 6 * 4, 64 * 32 * 3 * 4, 64 * 32 * 4, 64 * 1 * 4]  # in, in, in, out
    assert sizes == sorted(per_context * 2 * 2)  # two contexts, pinned + device each
    engine.close()
    assert set(trt.memory.blocks) == before
    assert not trt.memory.streams


def test_buffers_are_reused_across_batches(trt, plan: bytes, inputs_factory) -> None:
    engine = TensorRTEngine(plan, precision="fp32")
    blocks = set(trt.memory.blocks)
    for n in (1, 7, 64):
        engine.infer(inputs_factory(n, length=5))
    assert set(trt.memory.blocks) == blocks


def test_shape_outside_the_profile_is_refused_before_tensorrt(
    trt, plan: bytes, inputs_factory
) -> None:
    engine = TensorRTEngine(plan, precision="fp32")
    with pytest.raises(ShapeMismatch) as info:
        engine.infer(inputs_factory(3, length=80))
    assert info.value.tensor == "history"
    assert info.value.dims == (3, 80, 3)
    assert "1..32" in info.value.accepted
    assert not engine._logger.recent_errors()  # set_input_shape was never asked


def test_set_input_shape_false_is_a_shape_mismatch(trt, plan: bytes, inputs_factory) -> None:
    engine = TensorRTEngine(plan, precision="fp32")
    # Pretend the engine's own profile were wider than TensorRT's, so only TensorRT refuses.
    wide = DimRange(1, 1, None)
    loose = Profile(
        0,
        tuple(
            TensorSpec(s.name, s.dtype, (wide,) * len(s.dims)) for s in engine.profiles[0].inputs
        ),
    )
    for worker in engine._all:
        worker.profile = loose
    engine.profiles = (loose,)
    with pytest.raises(ShapeMismatch, match="TensorRT refused"):
        engine.infer(inputs_factory(2, length=40))
    assert any("Error Code 3" in m for m in engine._logger.recent_errors())


def test_execute_false_is_an_engine_failure(trt, plan: bytes, inputs_factory) -> None:
    engine = TensorRTEngine(plan, precision="fp32")
    trt.trt.execute_failure = "illegal memory access"
    with pytest.raises(EngineFailure, match="execute_async_v3 returned False"):
        engine.infer(inputs_factory(2))
    trt.trt.execute_failure = ""
    assert engine.infer(inputs_factory(2))["score"].shape == (2, 1)


def test_undeserializable_plan_is_unavailable(trt) -> None:
    with pytest.raises(EngineUnavailable, match="could not deserialize"):
        TensorRTEngine(b"not a plan", precision="fp16")


def test_plan_from_another_tensorrt_version_does_not_deserialize(
    trt, plan: bytes, install_trt
) -> None:
    other = "11.4.0" if trt.trt.__version__.startswith("10") else "10.13.0"
    install_trt(other)
    with pytest.raises(EngineUnavailable, match="version mismatch"):
        TensorRTEngine(plan, precision="fp32")


def test_contexts_run_concurrently(plan: bytes, inputs_factory, scores_concurrently) -> None:
    engine = TensorRTEngine(plan, precision="fp32")
    scores_concurrently(engine, [inputs_factory(4 + i, seed=i) for i in range(6)])


def test_plan_record_and_inspector_sit_beside_the_plan(trt, model_dir: Path) -> None:
    (path,) = build_engines(model_dir, ["fp32"], contexts=1)
    (record,) = PlanStore(model_dir).records("fp32")
    assert path == PlanStore(model_dir).plan_path(record.key)
    assert path.with_suffix(".layers.json").exists()
    assert record.key.compute_capability == "9.0"
    assert record.key.tensorrt_version == trt.trt.__version__
    assert len(record.profiles) == 1
    assert math.isfinite(record.build_seconds)


def _hold_in_copy_to_host(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, ...]:
    """Stops each batch at its first device-to-host copy until `go_on` is set."""
    in_run, go_on = threading.Event(), threading.Event()
    copy = CudaRuntime.copy_to_host

    def held(self: CudaRuntime, dst: int, src: int, nbytes: int, stream: object) -> None:
        in_run.set()
        go_on.wait(10)
        copy(self, dst, src, nbytes, stream)

    monkeypatch.setattr(CudaRuntime, "copy_to_host", held)
    return in_run, go_on


def _in_thread(call: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_close_frees_a_running_batchs_context_when_the_batch_ends(
    trt, plan: bytes, model_dir: Path, inputs_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry closes a retired version's engines once its drain time is up, even with a
    batch still running: that batch keeps its buffers and stream and scores as before."""
    before, streams = set(trt.memory.blocks), set(trt.memory.streams)
    engine = TensorRTEngine(plan, precision="fp32")
    per_context = (len(trt.memory.blocks) - len(before)) // 2
    in_run, go_on = _hold_in_copy_to_host(monkeypatch)
    inputs = inputs_factory(4, length=5)
    thread, result = _in_thread(lambda: engine.infer(inputs)["score"])
    assert in_run.wait(10)
    engine.close()
    assert len(set(trt.memory.blocks) - before) == per_context  # the idle context's are freed
    assert len(trt.memory.streams - streams) == 1
    with pytest.raises(EngineUnavailable, match="closed"):
        engine.infer(inputs)
    go_on.set()
    thread.join(10)
    expected = OnnxRuntimeEngine.from_path(model_dir / "model.onnx").infer(inputs)["score"]
    np.testing.assert_allclose(result["value"], expected, rtol=1e-6)
    assert set(trt.memory.blocks) == before
    assert trt.memory.streams == streams


def test_a_call_waiting_for_a_context_at_close_is_refused(
    trt, model_dir: Path, inputs_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    (path,) = build_engines(model_dir, ["fp32"], contexts=1)
    engine = TensorRTEngine(path.read_bytes(), precision="fp32")
    in_run, go_on = _hold_in_copy_to_host(monkeypatch)
    running, _ = _in_thread(lambda: engine.infer(inputs_factory(2, length=5)))
    assert in_run.wait(10)
    waiting, refused = _in_thread(lambda: engine.infer(inputs_factory(3, length=5)))
    waiting.join(0.05)  # it waits for the one context
    engine.close()
    waiting.join(10)
    assert isinstance(refused["error"], EngineUnavailable)
    go_on.set()
    running.join(10)
    assert not trt.memory.streams
