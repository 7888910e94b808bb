"""ONNX Runtime backend: the embedded engine and the fallback behind TensorRT."""

from engines.onnxrt.engine import OnnxRuntimeEngine
from engines.onnxrt.loader import SessionFromPath, available_providers, default_providers

__all__ = ["OnnxRuntimeEngine", "SessionFromPath", "available_providers", "default_providers"]
