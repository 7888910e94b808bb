"""TensorRT engines as `service.models.loader` loads them, on the stand-in TensorRT and CUDA."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import onnx
import pytest
from loaders import small_loader
from modelkit import add_validated_variants, write_sequence_model, write_tabular_model

from engines.base import Engine
from engines.manifest import Manifest, load_manifest
from engines.onnxrt import OnnxRuntimeEngine
from engines.output import ScoreOutput, resolve_score_output
from engines.trt import TensorRTEngine, build_engines
from service.errors import Unavailable
from service.models.loader import EngineFactory, VersionLoader, default_engines


def _tabular_with_plans(root: Path) -> Path:
    path = write_tabular_model(root)
    add_validated_variants(path)
    data = json.loads((path / "manifest.json").read_text())
    data["profiles"] = {"fp32": [{"batch": [1, 8, 32]}]}
    (path / "manifest.json").write_text(json.dumps(data))
    build_engines(path, ["fp16", "int8"])
    return path


def _loader(tensorrt: bool) -> VersionLoader:
    return _version_loader(default_engines(1, 1, tensorrt=tensorrt, onnx_variants=False))


def _version_loader(factory: EngineFactory) -> VersionLoader:
    return small_loader(factory)


def test_a_cuda_failure_loading_plans_serves_the_version_without_tensorrt(
    trt, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _tabular_with_plans(tmp_path)
    served = {e.name for e in _loader(tensorrt=True).build(path).pool.engines}
    assert {"tensorrt-fp16", "tensorrt-int8"} <= served
    trt.memory.device_capacity_bytes = trt.memory.device_bytes()  # no room for another engine
    with caplog.at_level(logging.WARNING, logger="service.models.loader"):
        model = _loader(tensorrt=True).build(path)
    assert model.pool.engines == ()
    assert model.pool.fallback.kind == "onnxruntime"
    assert "no TensorRT engines: CUDA cudaMalloc failed" in caplog.text


def test_a_version_refused_after_its_engines_were_made_closes_them(
    trt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The history.broadcast check refuses the version after the factory made a TensorRT
    engine and the ONNX Runtime fallback: both are closed, no device memory or stream left."""
    path = write_sequence_model(tmp_path, name="seq-cat", join="concat", broadcast=True)
    data = json.loads((path / "manifest.json").read_text())
    data["profiles"] = {"fp32": [{"batch": [1, 8, 64], "history_length": [1, 16, 64]}]}
    (path / "manifest.json").write_text(json.dumps(data))
    (plan,) = build_engines(path, ["fp32"])
    closed: list[Engine] = []
    close = OnnxRuntimeEngine.close
    monkeypatch.setattr(OnnxRuntimeEngine, "close", lambda e: (closed.append(e), close(e))[1])

    def factory(path: Path, manifest: Manifest, score: ScoreOutput) -> tuple[list[Engine], Engine]:
        fallback = OnnxRuntimeEngine.from_model_dir(path, manifest, score=score)
        return [TensorRTEngine(plan.read_bytes(), precision="fp32"), fallback], fallback

    with pytest.raises(Unavailable, match=r"declares history\.broadcast"):
        _version_loader(factory).build(path)
    assert not trt.memory.blocks and not trt.memory.streams
    assert [e.name for e in closed] == ["onnxruntime-cpu"]


def test_an_engine_factory_failing_part_way_closes_the_engines_it_made(
    trt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The TensorRT engines are loaded, then an ONNX variant's session fails to open."""
    path = _tabular_with_plans(tmp_path)
    made = OnnxRuntimeEngine.from_model_dir

    def from_model_dir(*args: object, precision: str = "fp32", **options: object) -> Engine:
        if precision != "fp32":
            raise MemoryError("no memory for another session")
        return made(*args, precision=precision, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(OnnxRuntimeEngine, "from_model_dir", from_model_dir)
    manifest = load_manifest(path)
    score = resolve_score_output(onnx.load(path / "model.onnx"), manifest)
    with pytest.raises(MemoryError):
        default_engines(1, 1, tensorrt=True, onnx_variants=True)(path, manifest, score)
    assert not trt.memory.blocks and not trt.memory.streams


def test_a_plan_with_a_short_history_profile_is_probed_for_broadcast_inside_it(
    trt, tmp_path: Path
) -> None:
    """Histories of up to 16 rows in the plan, 64 in the manifest: the probe uses 16 and finds
    that the graph (a Concat of history and features) does not broadcast."""
    path = write_sequence_model(
        tmp_path, name="seq-cat", join="concat", broadcast=True, max_length=64
    )
    data = json.loads((path / "manifest.json").read_text())
    data["profiles"] = {"fp32": [{"batch": [1, 8, 64], "history_length": [1, 8, 16]}]}
    (path / "manifest.json").write_text(json.dumps(data))
    (plan,) = build_engines(path, ["fp32"])

    def factory(path: Path, manifest: Manifest, score: ScoreOutput) -> tuple[list[Engine], Engine]:
        fallback = OnnxRuntimeEngine.from_model_dir(path, manifest, score=score)
        return [TensorRTEngine(plan.read_bytes(), precision="fp32"), fallback], fallback

    with pytest.raises(Unavailable, match=r"history\.broadcast, but engine tensorrt-fp32"):
        _version_loader(factory).build(path)
