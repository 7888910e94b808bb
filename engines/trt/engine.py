"""`TensorRTEngine`: a deserialized plan with one execution context per optimization profile.

Each context has its own CUDA stream and its own pinned host and device buffers, sized once
for its profile's largest shapes and reused. A batch's shapes are checked against the profile
before `set_input_shape`, and the boolean returns of `set_input_shape` and `execute_async_v3`
are checked as well, since TensorRT reports a refused shape by returning False, not by raising.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.base import (
    DimRange,
    Engine,
    EngineFailure,
    EngineUnavailable,
    Profile,
    ShapeMismatch,
    TensorSpec,
)
from engines.trt.cuda import CudaRuntime
from engines.trt.lib import import_tensorrt
from engines.trt.logger import make_logger

__all__ = ["TensorRTEngine"]


@dataclass(slots=True)
class _Buffer:
    """One tensor's pinned host and device memory, sized for the profile's maximum."""

    name: str
    dtype: np.dtype
    nbytes: int
    host_ptr: int
    device_ptr: int
    host: np.ndarray = field(repr=False)


@dataclass(slots=True, eq=False)
class _Worker:
    profile: Profile
    context: Any
    stream: Any
    inputs: dict[str, _Buffer]
    outputs: dict[str, _Buffer]


def _host_view(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


class TensorRTEngine(Engine):
    """Runs a TensorRT plan; `max_concurrency` is the number of execution contexts."""

    kind = "tensorrt"

    def __init__(
        self,
        plan: bytes,
        *,
        precision: str,
        logger: Any | None = None,
        name: str | None = None,
        cuda: CudaRuntime | None = None,
    ) -> None:
        trt = import_tensorrt()
        self._trt = trt
        self._logger = logger if logger is not None else make_logger(trt)
        self._cuda = cuda if cuda is not None else CudaRuntime()
        self.precision = precision
        self.name = name or f"tensorrt-{precision}"
        self._runtime = trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise EngineUnavailable(
                f"TensorRT could not deserialize the {precision} plan: "
                f"{self._logger.recent_errors()}"
            )
        self._engine = engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self._input_names = [n for n in names if engine.get_tensor_mode(n) == mode]
        self._output_names = [n for n in names if engine.get_tensor_mode(n) != mode]
        self._dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        self.profiles = tuple(self._profile(k) for k in range(engine.num_optimization_profiles))
        self._cond = threading.Condition()
        self._closed = False
        self._free: list[_Worker] = []
        self._busy: list[_Worker] = []
        self._all: list[_Worker] = []
        try:
            for profile in self.profiles:
                self._all.append(self._make_worker(profile))
        except Exception:
            self.close()
            raise
        self._free = list(self._all)
        self.max_concurrency = len(self._all)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(self._output_names)

    def _profile(self, index: int) -> Profile:
        specs = []
        for name in self._input_names:
            lo, opt, hi = (
                tuple(int(d) for d in dims)
                for dims in self._engine.get_tensor_profile_shape(name, index)
            )
            dims = tuple(DimRange(a, b, c) for a, b, c in zip(lo, opt, hi, strict=True))
            specs.append(TensorSpec(name, self._dtypes[name].name, dims))
        return Profile(index=index, inputs=tuple(specs))

    def _buffer(self, name: str, shape: tuple[int, ...]) -> _Buffer:
        dtype = self._dtypes[name]
        nbytes = max(1, math.prod(shape)) * dtype.itemsize
        host_ptr = self._cuda.malloc_host(nbytes)
        try:
            device_ptr = self._cuda.malloc(nbytes)
        except EngineFailure:
            self._cuda.free_host(host_ptr)
            raise
        return _Buffer(name, dtype, nbytes, host_ptr, device_ptr, _host_view(host_ptr, nbytes))

    def _make_worker(self, profile: Profile) -> _Worker:
        context = self._engine.create_execution_context()
        if context is None:
            raise EngineUnavailable(f"{self.name}: no context for profile {profile.index}")
        stream = self._cuda.stream_create()
        worker = _Worker(profile, context, stream, {}, {})
        try:
            if not context.set_optimization_profile_async(profile.index, int(stream)):
                raise EngineUnavailable(f"{self.name}: cannot select profile {profile.index}")
            self._cuda.synchronize(stream)
            for spec in profile.inputs:
                largest = tuple(int(d.max_value or d.opt_value) for d in spec.dims)
                worker.inputs[spec.name] = self._buffer(spec.name, largest)
                if not context.set_input_shape(spec.name, largest):
                    raise EngineUnavailable(f"{self.name}: profile maximum of {spec.name} refused")
            for name in self._output_names:
                largest = tuple(int(d) for d in context.get_tensor_shape(name))
                if any(d < 0 for d in largest):
                    raise EngineUnavailable(f"{self.name}: output {name} has data-dependent dims")
                worker.outputs[name] = self._buffer(name, largest)
            for buf in (*worker.inputs.values(), *worker.outputs.values()):
                if not context.set_tensor_address(buf.name, buf.device_ptr):
                    raise EngineUnavailable(f"{self.name}: set_tensor_address({buf.name}) failed")
        except Exception:
            self._release_worker(worker)
            raise
        return worker

    def _acquire(self, shapes: Mapping[str, tuple[int, ...]]) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise EngineUnavailable(f"{self.name} is closed")
                for worker in self._free:
                    if worker.profile.fits(shapes):
                        self._free.remove(worker)
                        self._busy.append(worker)
                        return worker
                if not any(w.profile.fits(shapes) for w in self._all):
                    self.select_profile(shapes)  # raises ShapeMismatch naming the tensor
                    raise EngineFailure(f"{self.name}: no open execution context fits")
                self._cond.wait()

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            self._busy.remove(worker)
            if not self._closed:
                self._free.append(worker)
                self._cond.notify()
                return
            last = not self._busy
        # close() left this worker's memory and stream to the batch using them until now.
        self._release_worker(worker)
        if last:
            self._engine = None

    def _infer(self, inputs: Mapping[str, np.ndarray], profile: Profile) -> dict[str, np.ndarray]:
        missing = [n for n in self._input_names if n not in inputs]
        if missing:
            raise EngineFailure(f"{self.name}: missing inputs {missing}")
        arrays = {
            n: np.ascontiguousarray(inputs[n], dtype=self._dtypes[n]) for n in self._input_names
        }
        shapes = {n: tuple(int(d) for d in a.shape) for n, a in arrays.items()}
        worker = self._acquire(shapes)
        try:
            return self._run(worker, arrays, shapes)
        finally:
            self._release(worker)

    def _run(
        self,
        worker: _Worker,
        arrays: Mapping[str, np.ndarray],
        shapes: Mapping[str, tuple[int, ...]],
    ) -> dict[str, np.ndarray]:
        context, stream = worker.context, worker.stream
        # Check before set_input_shape: TensorRT only logs a refused shape and returns False.
        for spec in worker.profile.inputs:
            if not spec.fits(shapes[spec.name]):
                raise ShapeMismatch(spec.name, shapes[spec.name], spec.describe())
        for name, arr in arrays.items():
            buf = worker.inputs[name]
            flat = arr.reshape(-1).view(np.uint8)
            buf.host[: flat.size] = flat
            self._cuda.copy_to_device(buf.device_ptr, buf.host_ptr, flat.size, stream)
            if not context.set_input_shape(name, shapes[name]):
                raise ShapeMismatch(
                    name,
                    shapes[name],
                    f"profile {worker.profile.index} of {self.name} (TensorRT refused the shape)",
                )
        if not context.execute_async_v3(int(stream)):
            self._cuda.synchronize(stream)
            raise EngineFailure(
                f"{self.name}: execute_async_v3 returned False: {self._logger.recent_errors()[-3:]}"
            )
        out_shapes = {}
        for name, buf in worker.outputs.items():
            shape = tuple(int(d) for d in context.get_tensor_shape(name))
            nbytes = math.prod(shape) * buf.dtype.itemsize
            if nbytes > buf.nbytes:
                raise EngineFailure(f"{self.name}: output {name} {list(shape)} exceeds its buffer")
            self._cuda.copy_to_host(buf.host_ptr, buf.device_ptr, nbytes, stream)
            out_shapes[name] = (shape, nbytes)
        self._cuda.synchronize(stream)
        return {
            name: worker.outputs[name]
            .host[:nbytes]
            .view(worker.outputs[name].dtype)
            .reshape(shape)
            .copy()
            for name, (shape, nbytes) in out_shapes.items()
        }

    def _release_worker(self, worker: _Worker) -> None:
        for buf in (*worker.inputs.values(), *worker.outputs.values()):
            self._cuda.free(buf.device_ptr)
            self._cuda.free_host(buf.host_ptr)
        worker.inputs.clear()
        worker.outputs.clear()
        if worker.stream is not None:
            self._cuda.stream_destroy(worker.stream)
            worker.stream = None
        worker.context = None

    def close(self) -> None:
        """Free every idle context's buffers and stream now, and each busy one's when its batch
        ends: a batch still running (past a drain, or hung under the watchdog) keeps reading
        and writing them. Later calls raise `EngineUnavailable`."""
        with self._cond:
            self._closed = True
            idle = [w for w in self._all if w not in self._busy]
            self._all, self._free = [], []
            done = not self._busy
            self._cond.notify_all()  # callers waiting for a context raise instead
        for worker in idle:
            self._release_worker(worker)
        if done:  # else the last busy context's release drops it: a context needs its engine
            self._engine = None
