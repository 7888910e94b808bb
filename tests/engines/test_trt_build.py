"""Plan building against the stand-in tensorrt module, for TensorRT 10 and 11 behaviour."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from engines.base import EngineUnavailable
from engines.manifest import ProfileSpec
from engines.trt import PlanBuildError, build_engines, build_plan, make_logger, precision_flags
from engines.trt.build import profile_shapes, repeat_profiles

SPEC = ProfileSpec(batch=(1, 16, 64), history_length=(1, 16, 32))


def _build(trt, model_dir: Path, precision: str = "fp16", contexts: int = 2, cache=None):
    logger = make_logger(trt)
    return build_plan(
        model_dir / "model.onnx",
        repeat_profiles([SPEC], contexts),
        1 << 28,
        cache,
        precision,
        logger,
    )


def test_builder_call_sequence(trt, model_dir: Path, tmp_path: Path) -> None:
    built = _build(trt.trt, model_dir, "fp16", contexts=3, cache=tmp_path / "timing.cache")
    calls = trt.trt.calls
    assert calls[0] == "create_network:0"
    assert calls[1] == "parse_from_file"
    assert f"set_memory_pool_limit:WORKSPACE:{1 << 28}" in calls
    assert calls.count("add_optimization_profile") == 3
    order = [c for c in calls if c in ("set_timing_cache", "build_serialized_network")]
    assert order == ["set_timing_cache", "build_serialized_network"]
    assert calls.index("get_timing_cache") > calls.index("build_serialized_network")
    assert json.loads(built.inspector_json)["Layers"][0]["LayerType"] == "Unsqueeze"
    assert built.plan


def test_precision_flags_only_where_tensorrt_has_them(trt, model_dir: Path) -> None:
    built = _build(trt.trt, model_dir, "int8")
    flag_calls = [c for c in trt.trt.calls if c.startswith("set_flag")]
    if trt.trt.__version__.startswith("10"):
        assert built.flags == ("INT8", "FP16")
        assert flag_calls == ["set_flag:INT8", "set_flag:FP16"]
    else:
        assert built.flags == ()
        assert flag_calls == []
    assert precision_flags(trt.trt, "fp32") == ()


def test_timing_cache_is_saved_and_reused(trt, model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "timing.cache"
    _build(trt.trt, model_dir, cache=cache)
    first = cache.read_bytes()
    _build(trt.trt, model_dir, cache=cache)
    # The second build started from the first one's cache and added to it.
    assert first.endswith(b"1") and cache.read_bytes().endswith(b"2")


def test_a_timing_cache_from_another_gpu_is_replaced_with_a_warning(
    trt, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """TensorRT refuses a cache timed on another device, even one of the same compute
    capability (an H100's on an H200): the build starts from an empty cache and saves it."""
    cache = tmp_path / "timing.cache"
    trt.memory.device_name = "NVIDIA H100 80GB HBM3"
    _build(trt.trt, model_dir, cache=cache)
    _build(trt.trt, model_dir, cache=cache)
    trt.memory.device_name = "NVIDIA H200"
    with caplog.at_level(logging.WARNING, logger="engines.trt.build"):
        assert _build(trt.trt, model_dir, cache=cache).plan
    assert f"TensorRT refused the timing cache {cache}" in caplog.text
    assert b"NVIDIA H200" in cache.read_bytes() and cache.read_bytes().endswith(b"1")


def test_an_unreadable_timing_cache_is_replaced_with_a_warning(
    trt, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"\x00 cut short")
    with caplog.at_level(logging.WARNING, logger="engines.trt.build"):
        assert _build(trt.trt, model_dir, cache=cache).plan
    assert "TensorRT refused the timing cache" in caplog.text
    assert cache.read_bytes().endswith(b"1")


def test_each_gpu_and_tensorrt_version_keeps_its_own_timing_cache(
    trt, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trt.memory.capability = (8, 9)
    build_engines(model_dir, ["fp32"])
    trt.memory.capability = (9, 0)
    with caplog.at_level(logging.WARNING):
        build_engines(model_dir, ["fp32"])
    version = trt.trt.__version__
    caches = sorted(p.name for p in (model_dir / "engines").glob("timing.*"))
    assert caches == [f"timing.sm89.trt{version}.cache", f"timing.sm90.trt{version}.cache"]
    assert "timing cache" not in caplog.text


def test_failed_build_reports_the_loggers_errors(trt, model_dir: Path) -> None:
    trt.trt.build_failure = "Error Code 2: out of tactics for node MatMul_6"
    with pytest.raises(PlanBuildError, match="out of tactics"):
        _build(trt.trt, model_dir)


def test_unparseable_onnx_is_a_build_error(trt, tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"garbage")
    with pytest.raises(PlanBuildError, match="could not parse"):
        _build(trt.trt, tmp_path)


def test_profile_shapes_from_the_manifest() -> None:
    shapes = profile_shapes(
        [("features", (-1, 6)), ("history", (-1, -1, 3)), ("history_mask", (-1, -1))],
        SPEC,
        ("history", "history_mask"),
    )
    assert shapes["features"].max == (64, 6)
    assert shapes["history"].min == (1, 1, 3)
    assert shapes["history"].opt == (16, 16, 3)
    assert shapes["history_mask"].max == (64, 32)


def test_unknown_dynamic_axis_is_refused() -> None:
    with pytest.raises(PlanBuildError, match="axis 2"):
        profile_shapes([("x", (-1, 4, -1))], SPEC, ())


def test_disordered_profile_is_refused() -> None:
    # The manifest refuses such a range; built unchecked, it shows the build's own guard.
    bad = ProfileSpec.model_construct(batch=(8, 4, 64), history_length=None)
    with pytest.raises(PlanBuildError, match="min <= opt <= max"):
        profile_shapes([("x", (-1, 4))], bad, ())


def test_logger_forwards_to_python_logging(trt, caplog: pytest.LogCaptureFixture) -> None:
    logger = make_logger(trt.trt, name="engines.trt.test")
    with caplog.at_level(logging.DEBUG, logger="engines.trt.test"):
        logger.log(trt.trt.ILogger.Severity.WARNING, "slow tactic")
        logger.log(trt.trt.ILogger.Severity.ERROR, "broken")
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.ERROR]
    assert logger.recent_errors() == ["broken"]
    assert isinstance(logger, trt.trt.ILogger)


def test_build_engines_without_tensorrt_is_unavailable(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import then raises ImportError
    with pytest.raises(EngineUnavailable, match=r"^TensorRT is not installed: "):
        build_engines(model_dir)


def test_type_stubs_alone_are_not_tensorrt(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    with pytest.raises(EngineUnavailable, match=r"^TensorRT is not installed: "):
        build_engines(model_dir)
