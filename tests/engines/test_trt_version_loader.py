"""TensorRT engines as `service.models.loader` loads them, on the stand-in TensorRT and CUDA."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from modelkit import add_validated_variants, write_tabular_model

from engines.trt import build_engines
from service.models.loader import VersionLoader, default_engines


def _tabular_with_plans(root: Path) -> Path:
    path = write_tabular_model(root)
    add_validated_variants(path)
    data = json.loads((path / "manifest.json").read_text())
    data["profiles"] = {"fp32": [{"batch": [1, 8, 32]}]}
    (path / "manifest.json").write_text(json.dumps(data))
    build_engines(path, ["fp16", "int8"])
    return path


def _loader(tensorrt: bool) -> VersionLoader:
    return VersionLoader(
        default_engines(1, 1, tensorrt=tensorrt, onnx_variants=False),
        max_batch_rows=16,
        max_queue_rows=64,
        workers=1,
        max_queue_delay_s=0.0,
        warmup_iterations=0,
        degrade_on_deadline=False,
    )


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
