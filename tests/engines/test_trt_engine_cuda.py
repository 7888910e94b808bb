"""`TensorRTEngine`'s CUDA side on a real GPU: pinned and device buffers, streams and copies.

TensorRT itself cannot be installed everywhere a GPU can be had, so here the stand-in
`tensorrt` executes the plan (with ONNX Runtime, as in test_trt_engine.py) but reads its inputs
from and writes its outputs to real device memory, through the real CUDA runtime. Everything
the engine does with CUDA (allocation, pinned staging, asynchronous copies on each context's
stream, synchronization, freeing) runs on the device. Skipped, with the reason, where
cuda-python or a CUDA device is missing; tests/gpu covers real TensorRT engines.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.base import EngineFailure, EngineUnavailable, ShapeMismatch
from engines.onnxrt import OnnxRuntimeEngine
from engines.trt import TensorRTEngine, build_engines
from engines.trt.cuda import CudaRuntime

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda() -> CudaRuntime:
    try:
        runtime = CudaRuntime()
        runtime.compute_capability()
    except (EngineUnavailable, EngineFailure) as exc:
        pytest.skip(f"needs cuda-python and a CUDA device: {exc}")
    return runtime


def _host(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


class DeviceMemory:
    """The stand-in's access to device memory, through the real runtime and driver.

    Copies are synchronous on the legacy default stream, which waits for work queued on the
    engine's (blocking) streams, so the stand-in sees its inputs after the engine's
    asynchronous uploads, as a kernel on the engine's stream would. An access that does not
    lie inside one allocation is refused, as the stand-in's own memory refuses it.
    """

    def __init__(self, rt: Any) -> None:
        from cuda.bindings import driver

        self.rt, self.driver = rt, driver
        self.reads = self.writes = 0

    def _inside(self, ptr: int, nbytes: int) -> bool:
        err, base, size = self.driver.cuMemGetAddressRange(ptr)
        if err != self.driver.CUresult.CUDA_SUCCESS:
            return False
        return int(base) <= ptr and ptr + nbytes <= int(base) + int(size)

    def _copy(self, dst: int, src: int, nbytes: int, kind: Any) -> None:
        (err,) = self.rt.cudaMemcpy(dst, src, nbytes, kind)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaMemcpy failed: {err}")

    def read(self, ptr: int, nbytes: int, device: bool) -> bytes:
        if not device or not self._inside(ptr, nbytes):
            raise ValueError("read outside a device allocation")
        out = np.empty(nbytes, dtype=np.uint8)
        self._copy(out.ctypes.data, ptr, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)
        self.reads += 1
        return out.tobytes()

    def write(self, ptr: int, data: bytes) -> bool:
        if not self._inside(ptr, len(data)):
            return False
        src = np.frombuffer(data, dtype=np.uint8)
        self._copy(ptr, src.ctypes.data, len(data), self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice)
        self.writes += 1
        return True


class CountingCuda(CudaRuntime):
    """The real runtime, keeping the allocations and streams that are still open."""

    def __init__(self, rt: Any) -> None:
        super().__init__(rt)
        self.device: set[int] = set()
        self.pinned: set[int] = set()
        self.streams = 0

    def malloc(self, nbytes: int) -> int:
        ptr = super().malloc(nbytes)
        self.device.add(ptr)
        return ptr

    def malloc_host(self, nbytes: int) -> int:
        ptr = super().malloc_host(nbytes)
        self.pinned.add(ptr)
        return ptr

    def free(self, ptr: int) -> None:
        super().free(ptr)
        self.device.remove(ptr)

    def free_host(self, ptr: int) -> None:
        super().free_host(ptr)
        self.pinned.remove(ptr)

    def stream_create(self) -> Any:
        self.streams += 1
        return super().stream_create()

    def stream_destroy(self, stream: Any) -> None:
        super().stream_destroy(stream)
        self.streams -= 1


def test_runtime_round_trip_through_pinned_and_device_memory(cuda: CudaRuntime) -> None:
    assert re.fullmatch(r"\d+\.\d+", cuda.compute_capability())
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    n = data.nbytes
    src, dst, dev = cuda.malloc_host(n), cuda.malloc_host(n), cuda.malloc(n)
    stream = cuda.stream_create()
    try:
        _host(src, n)[:] = data
        _host(dst, n)[:] = 0
        cuda.copy_to_device(dev, src, n, stream)
        cuda.copy_to_host(dst, dev, n, stream)
        cuda.synchronize(stream)
        np.testing.assert_array_equal(_host(dst, n), data)
    finally:
        cuda.stream_destroy(stream)
        cuda.free(dev)
        cuda.free_host(dst)
        cuda.free_host(src)


def test_a_refused_allocation_is_an_engine_failure_and_not_sticky(cuda: CudaRuntime) -> None:
    with pytest.raises(EngineFailure, match=r"cudaMalloc failed: cudaErrorMemoryAllocation"):
        cuda.malloc(1 << 50)  # a pebibyte
    ptr = cuda.malloc(256)
    cuda.free(ptr)


@pytest.fixture
def on_device(cuda: CudaRuntime, install_trt_only, model_dir: Path):
    memory = DeviceMemory(cuda.rt)
    install_trt_only(memory)
    (path,) = build_engines(model_dir, ["fp32"], contexts=2, cuda=cuda)
    counting = CountingCuda(cuda.rt)
    engine = TensorRTEngine(path.read_bytes(), precision="fp32", cuda=counting)
    yield engine, counting, memory
    engine.close()


def test_plan_key_carries_the_device_compute_capability(
    cuda: CudaRuntime, on_device, model_dir: Path
) -> None:
    sm = cuda.compute_capability().replace(".", "")
    (plan,) = (model_dir / "engines").glob("*.plan")
    assert f".sm{sm}." in plan.name


def test_scores_on_device_memory_match_onnxruntime(on_device, model_dir, inputs_factory) -> None:
    engine, counting, memory = on_device
    reference = OnnxRuntimeEngine.from_path(model_dir / "model.onnx")
    pinned, device = set(counting.pinned), set(counting.device)
    assert len(device) == len(pinned) == 2 * 4  # two contexts: three inputs and one output
    for n, length in ((1, 3), (17, 12), (64, 32)):
        inputs = inputs_factory(n, length=length, seed=n)
        got = engine.infer(inputs)["score"]
        np.testing.assert_allclose(got, reference.infer(inputs)["score"], rtol=1e-6)
    assert (counting.pinned, counting.device) == (pinned, device)  # reused, none added
    assert memory.reads == 3 * 3 and memory.writes == 3


def test_shape_outside_the_profile_never_reaches_the_device(on_device, inputs_factory) -> None:
    engine, _counting, memory = on_device
    with pytest.raises(ShapeMismatch) as info:
        engine.infer(inputs_factory(3, length=80))
    assert info.value.tensor == "history"
    assert memory.reads == memory.writes == 0


def test_contexts_run_concurrently_on_their_own_streams(
    on_device, inputs_factory, scores_concurrently
) -> None:
    engine, counting, _memory = on_device
    assert counting.streams == 2
    scores_concurrently(engine, [inputs_factory(4 + i, seed=i) for i in range(8)], times=5)


def test_close_frees_every_buffer_and_stream(on_device) -> None:
    engine, counting, _memory = on_device
    engine.close()
    assert not counting.device
    assert not counting.pinned
    assert counting.streams == 0
