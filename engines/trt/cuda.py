"""The few CUDA runtime calls the TensorRT engine needs, through NVIDIA's cuda-python.

Every `cuda.bindings.runtime` call returns a tuple whose first item is a `cudaError_t`; `call`
checks it once here so the engine code reads straight. Imported lazily: a CPU host never loads it.
"""

from __future__ import annotations

from typing import Any

from engines.base import EngineFailure, EngineUnavailable

__all__ = ["CudaRuntime", "load_cudart"]


def load_cudart() -> Any:
    """`cuda.bindings.runtime` (cuda-python 12.6+), else the older `cuda.cudart` module."""
    try:
        from cuda.bindings import runtime

        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart  # type: ignore[attr-defined]

        return cudart
    except ImportError as exc:
        raise EngineUnavailable(f"cuda-python is not installed: {exc}") from exc


class CudaRuntime:
    """Checked wrappers: each returns the call's value or raises `EngineFailure`."""

    def __init__(self, cudart: Any | None = None) -> None:
        self.rt = cudart if cudart is not None else load_cudart()

    def call(self, what: str, result: Any) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise EngineFailure(f"CUDA {what} failed: {getattr(err, 'name', err)}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def malloc(self, nbytes: int) -> int:
        return int(self.call("cudaMalloc", self.rt.cudaMalloc(nbytes)))

    def malloc_host(self, nbytes: int) -> int:
        return int(self.call("cudaMallocHost", self.rt.cudaMallocHost(nbytes)))

    def free(self, ptr: int) -> None:
        self.call("cudaFree", self.rt.cudaFree(ptr))

    def free_host(self, ptr: int) -> None:
        self.call("cudaFreeHost", self.rt.cudaFreeHost(ptr))

    def stream_create(self) -> Any:
        return self.call("cudaStreamCreate", self.rt.cudaStreamCreate())

    def stream_destroy(self, stream: Any) -> None:
        self.call("cudaStreamDestroy", self.rt.cudaStreamDestroy(stream))

    def synchronize(self, stream: Any) -> None:
        self.call("cudaStreamSynchronize", self.rt.cudaStreamSynchronize(stream))

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.call("cudaMemcpyAsync", self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream))

    def copy_to_host(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self.call("cudaMemcpyAsync", self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream))

    def compute_capability(self, device: int | None = None) -> str:
        """``major.minor`` of the current (or given) device, e.g. ``9.0`` for an H200."""
        if device is None:
            device = int(self.call("cudaGetDevice", self.rt.cudaGetDevice()))
        attr = self.rt.cudaDeviceAttr
        major = self.call(
            "cudaDeviceGetAttribute",
            self.rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, device),
        )
        minor = self.call(
            "cudaDeviceGetAttribute",
            self.rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, device),
        )
        return f"{int(major)}.{int(minor)}"
