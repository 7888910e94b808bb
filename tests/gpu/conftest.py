"""GPU tests need TensorRT, cuda-python and a CUDA device; without them they skip, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "models" / "fraud-demo" / "1"


def _missing() -> str:
    from engines.base import EngineUnavailable
    from engines.trt.cuda import CudaRuntime
    from engines.trt.lib import import_tensorrt

    try:
        import_tensorrt()
        cuda = CudaRuntime()
    except EngineUnavailable as exc:
        return f"{exc} (see docs/engines.md: GPU hosts)"
    try:
        cuda.compute_capability()
    except Exception as exc:
        return f"no usable CUDA device: {exc}"
    if not (DEMO / "model.onnx").exists():
        return f"demo model missing: {DEMO.name} has no model.onnx"
    return ""


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    reason = _missing()
    if reason:
        pytest.skip(reason)
    return DEMO
