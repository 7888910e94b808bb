"""Lazy access to the `tensorrt` module, so the package imports on hosts without it."""

from __future__ import annotations

from typing import Any

from engines.base import EngineUnavailable

__all__ = ["import_tensorrt", "tensorrt_major"]


def import_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError as exc:
        raise EngineUnavailable(
            f"TensorRT is not installed: {exc}. Install it from NVIDIA's package index "
            "or run inside NVIDIA's TensorRT container."
        ) from exc
    if not hasattr(tensorrt, "Builder"):
        # Type stubs alone leave an empty namespace package named tensorrt.
        raise EngineUnavailable(
            "TensorRT is not installed: the importable 'tensorrt' has no bindings "
            "(type stubs only?)"
        )
    return tensorrt


def tensorrt_major(trt: Any) -> int:
    return int(str(trt.__version__).split(".")[0])
