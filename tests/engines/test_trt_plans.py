"""Plan keys, build records and refusal of stale or foreign plans."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import onnx
import pytest

from engines.trt import PlanKey, PlanRefused, PlanStore, build_engines, load_engines
from engines.trt.cuda import CudaRuntime
from engines.trt.loader import current_key


def _key(trt, model_dir: Path) -> PlanKey:
    return current_key(trt.trt, CudaRuntime(), model_dir / "model.onnx", "fp32")


def test_key_names_gpu_tensorrt_precision_and_onnx_hash(trt, model_dir: Path) -> None:
    key = _key(trt, model_dir)
    assert key.compute_capability == "9.0"
    assert key.stem == f"fp32.sm90.trt{trt.trt.__version__}.{key.onnx_sha256[:16]}"
    assert len(key.onnx_sha256) == 64


def test_current_plan_loads_and_is_not_rebuilt(trt, model_dir: Path) -> None:
    build_engines(model_dir, ["fp32"])
    build_engines(model_dir, ["fp32"])
    assert trt.trt.calls.count("build_serialized_network") == 1
    assert PlanStore(model_dir).load(_key(trt, model_dir))


def test_plan_for_a_changed_onnx_is_refused(trt, model_dir: Path, model_factory) -> None:
    build_engines(model_dir, ["fp32"])
    onnx.save(model_factory(seed=3), model_dir / "model.onnx")
    with pytest.raises(PlanRefused, match="ONNX sha256") as info:
        PlanStore(model_dir).load(_key(trt, model_dir))
    assert info.value.reason == "stale_onnx"


@pytest.mark.parametrize(
    ("change", "reason"),
    [({"tensorrt_version": "9.9.9"}, "tensorrt_version"), ({"compute_capability": "8.6"}, "gpu")],
)
def test_foreign_plan_is_refused(trt, model_dir: Path, change: dict, reason: str) -> None:
    build_engines(model_dir, ["fp32"])
    wanted = replace(_key(trt, model_dir), **change)
    with pytest.raises(PlanRefused) as info:
        PlanStore(model_dir).load(wanted)
    assert info.value.reason == reason
    assert "rebuild" in str(info.value)


def test_record_that_disagrees_with_its_file_name_is_refused(trt, model_dir: Path) -> None:
    build_engines(model_dir, ["fp32"])
    store = PlanStore(model_dir)
    key = _key(trt, model_dir)
    other = replace(key, compute_capability="8.0")
    store.record_path(other).write_text(store.record_path(key).read_text())
    with pytest.raises(PlanRefused) as info:
        store.load(other)
    assert info.value.reason == "gpu"


def test_damaged_plan_is_refused(trt, model_dir: Path) -> None:
    build_engines(model_dir, ["fp32"])
    store = PlanStore(model_dir)
    key = _key(trt, model_dir)
    store.plan_path(key).write_bytes(store.plan_path(key).read_bytes()[:-3])
    with pytest.raises(PlanRefused) as info:
        store.load(key)
    assert info.value.reason == "corrupt"


def test_missing_plan_is_refused(trt, model_dir: Path) -> None:
    with pytest.raises(PlanRefused) as info:
        PlanStore(model_dir).load(_key(trt, model_dir))
    assert info.value.reason == "missing"


def test_load_engines_skips_stale_plans_unless_told_to_rebuild(
    trt, model_dir: Path, model_factory, caplog: pytest.LogCaptureFixture
) -> None:
    build_engines(model_dir, ["fp32"])
    onnx.save(model_factory(seed=3), model_dir / "model.onnx")
    accepted = {"fp32": model_dir / "model.onnx"}
    with caplog.at_level(logging.WARNING):
        assert load_engines(model_dir, accepted, ["fp32"]) == []
    assert "ONNX sha256" in caplog.text
    (engine,) = load_engines(model_dir, accepted, ["fp32"], rebuild_stale=True)
    assert engine.name == "tensorrt-fp32"
    assert trt.trt.calls.count("build_serialized_network") == 2


def test_refused_variant_is_never_loaded(trt, model_dir: Path) -> None:
    from engines.precision import make_variants

    make_variants(model_dir)
    build_engines(model_dir, ["fp16", "int8"])
    accepted = {"fp32": model_dir / "model.onnx", "fp16": model_dir / "model.fp16.onnx"}
    engines = load_engines(model_dir, accepted, ["fp16", "int8"])
    assert [e.name for e in engines] == ["tensorrt-fp16"]


def test_engines_loaded_before_a_failing_precision_are_closed(
    trt, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of device memory for the INT8 engine: the FP16 engine already made is closed."""
    from engines.base import EngineFailure
    from engines.precision import make_variants
    from engines.trt import TensorRTEngine

    make_variants(model_dir)
    fp16, _int8 = build_engines(model_dir, ["fp16", "int8"])
    memory = trt.memory
    allocations, streams = dict(memory.blocks), set(memory.streams)
    probe = TensorRTEngine(fp16.read_bytes(), precision="fp16")
    one_engine = memory.device_bytes()
    probe.close()
    memory.device_capacity_bytes = one_engine + one_engine // 2
    accepted = {
        "fp32": model_dir / "model.onnx",
        "fp16": model_dir / "model.fp16.onnx",
        "int8": model_dir / "model.int8.onnx",
    }
    made: list[str] = []
    real_init = TensorRTEngine.__init__

    def init(self: TensorRTEngine, plan: bytes, **options: object) -> None:
        real_init(self, plan, **options)  # type: ignore[arg-type]
        made.append(self.name)

    monkeypatch.setattr(TensorRTEngine, "__init__", init)
    with pytest.raises(EngineFailure, match="cudaMalloc"):
        load_engines(model_dir, accepted, ["fp16", "int8"])
    assert made == ["tensorrt-fp16"]
    assert memory.blocks.keys() == allocations.keys()
    assert memory.streams == streams
