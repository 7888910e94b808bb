"""Stand-in `tensorrt` and `cuda.bindings.runtime` modules that follow documented behaviour.

What they do, as the real libraries do (see the project's TensorRT notes):
- `ILogger` subclasses must call `ILogger.__init__`; errors are reported through the logger.
- `OnnxParser.parse_from_file` returns False and records errors for a bad file.
- `IOptimizationProfile.set_shape` raises on min/opt/max that are not ordered.
- `build_serialized_network` returns None (error in the logger) when a dynamic input has no
  range in a profile or fixed dims disagree.
- TensorRT 11 has no precision builder flags; `create_network` takes only 0 there.
- A timing cache is specific to the TensorRT version and the device: `set_timing_cache(cache,
  ignore_mismatch=False)` returns False for one made by another.
- `deserialize_cuda_engine` returns None for bytes that are not a plan of this version.
- `set_input_shape` returns False for a shape outside the active profile (it logs error code
  3, it does not raise); `execute_async_v3` returns False unless every input shape is valid
  and every tensor has an address.
- CUDA calls return ``(cudaError_t, value...)``; memory copies check their bounds.

Execution really computes the model (with ONNX Runtime on the bytes held in the "plan"),
reading inputs from and writing outputs to the stand-in device memory by address.
"""

from __future__ import annotations

import base64
import ctypes
import enum
import json
import types
from typing import Any

import numpy as np
import onnx

MAGIC = b"STANDIN-PLAN\n"
CACHE_MAGIC = b"STANDIN-CACHE\n"

_ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 3: "INT8", 7: "INT64", 6: "INT32", 9: "BOOL"}


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    INT64 = 8


_NP = {
    DataType.FLOAT: np.float32,
    DataType.HALF: np.float16,
    DataType.INT8: np.int8,
    DataType.INT32: np.int32,
    DataType.BOOL: np.bool_,
    DataType.INT64: np.int64,
}


def nptype(dtype: DataType) -> type:
    return _NP[dtype]


class Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class ILogger:
    Severity = Severity

    def __init__(self) -> None:
        self._standin_base_init = True

    def log(self, severity: Severity, msg: str) -> None:
        raise NotImplementedError


def _log(logger: Any, severity: Severity, msg: str) -> None:
    if not getattr(logger, "_standin_base_init", False):
        raise TypeError("ILogger subclass did not call ILogger.__init__")
    logger.log(severity, msg)


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0


class ProfilingVerbosity(enum.IntEnum):
    LAYER_NAMES_ONLY = 0
    NONE = 1
    DETAILED = 2


class LayerInformationFormat(enum.IntEnum):
    ONELINE = 0
    JSON = 1


class _Tensor:
    def __init__(self, name: str, shape: tuple[int, ...], symbols: tuple[str, ...], dtype: str):
        self.name = name
        self.shape = shape
        self.symbols = symbols
        self.dtype = DataType[dtype]


def _tensors(values: Any) -> list[_Tensor]:
    out = []
    for v in values:
        dims = v.type.tensor_type.shape.dim
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in dims)
        symbols = tuple(d.dim_param for d in dims)
        out.append(_Tensor(v.name, shape, symbols, _ONNX_TO_TRT[v.type.tensor_type.elem_type]))
    return out


class INetworkDefinition:
    def __init__(self) -> None:
        self.inputs: list[_Tensor] = []
        self.outputs: list[_Tensor] = []
        self.onnx: bytes = b""

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def get_input(self, index: int) -> _Tensor:
        return self.inputs[index]


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: Any) -> None:
        self.network = network
        self.logger = logger
        self.errors: list[str] = []

    def parse_from_file(self, path: str) -> bool:
        self.network.trt.calls.append("parse_from_file")
        try:
            model = onnx.load(path)
            onnx.checker.check_model(model)
        except Exception as exc:
            self.errors.append(f"ModelImporter: {type(exc).__name__}: {exc}")
            return False
        self.network.inputs = _tensors(model.graph.input)
        self.network.outputs = _tensors(model.graph.output)
        self.network.onnx = model.SerializeToString()
        return True

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> str:
        return self.errors[index]


class IOptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[tuple[int, ...], ...]] = {}

    def set_shape(self, name: str, min: Any, opt: Any, max: Any) -> None:
        lo, mid, hi = tuple(min), tuple(opt), tuple(max)
        if not len(lo) == len(mid) == len(hi):
            raise ValueError("min, opt and max differ in rank")
        if any(not a <= b <= c for a, b, c in zip(lo, mid, hi, strict=True)):
            raise ValueError(f"profile shapes for {name} are not min <= opt <= max")
        self.shapes[name] = (lo, mid, hi)


def _device(trt: Any) -> str:
    """What a timing cache's header records: the TensorRT version and the GPU it timed on."""
    memory = trt.cuda_memory
    if memory is None:
        return f"{trt.__version__} gpu"
    return f"{trt.__version__} {memory.device_name} sm{memory.capability[0]}{memory.capability[1]}"


class ITimingCache:
    """Serialized as the magic, a header line naming TensorRT and the device, the entries."""

    def __init__(self, data: bytes, device: str) -> None:
        header, _, entries = data[len(CACHE_MAGIC) :].partition(b"\n")
        self.device = header.decode() if data else device
        self.entries = int(entries or b"0")

    def serialize(self) -> memoryview:
        return memoryview(CACHE_MAGIC + self.device.encode() + b"\n" + str(self.entries).encode())


class IBuilderConfig:
    def __init__(self, trt: Any) -> None:
        self.trt = trt
        self.flags: list[Any] = []
        self.pools: dict[Any, int] = {}
        self.profiles: list[IOptimizationProfile] = []
        self.profiling_verbosity = ProfilingVerbosity.LAYER_NAMES_ONLY
        self.cache: ITimingCache | None = None

    def set_memory_pool_limit(self, pool: MemoryPoolType, size: int) -> None:
        self.trt.calls.append(f"set_memory_pool_limit:{pool.name}:{size}")
        self.pools[pool] = size

    def set_flag(self, flag: Any) -> None:
        self.trt.calls.append(f"set_flag:{flag.name}")
        self.flags.append(flag)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        self.trt.calls.append("add_optimization_profile")
        if not profile.shapes:
            return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def create_timing_cache(self, data: bytes) -> ITimingCache:
        self.trt.calls.append("create_timing_cache")
        if data and not bytes(data).startswith(CACHE_MAGIC):
            raise RuntimeError("not a timing cache")
        return ITimingCache(bytes(data), _device(self.trt))

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        """False for a cache from another TensorRT version or device, unless `ignore_mismatch`."""
        self.trt.calls.append("set_timing_cache")
        if cache.device != _device(self.trt) and not ignore_mismatch:
            return False
        self.cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache:
        self.trt.calls.append("get_timing_cache")
        assert self.cache is not None
        return self.cache


class Builder:
    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.trt = _module_of(self)

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        self.trt.calls.append(f"create_network:{flags}")
        if self.trt.__version__.startswith("11") and flags != 0:
            raise TypeError("TensorRT 11 networks take no creation flags")
        network = INetworkDefinition()
        network.trt = self.trt  # type: ignore[attr-defined]
        return network

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig(self.trt)

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> Any:
        self.trt.calls.append("build_serialized_network")
        problem = self.trt.build_failure or _check_profiles(network, config)
        if problem:
            _log(self.logger, Severity.ERROR, problem)
            return None
        if config.cache is not None:
            config.cache.entries += 1
        body = {
            "version": self.trt.__version__,
            "onnx": base64.b64encode(network.onnx).decode(),
            "inputs": [
                [t.name, list(t.shape), list(t.symbols), t.dtype.name] for t in network.inputs
            ],
            "outputs": [
                [t.name, list(t.shape), list(t.symbols), t.dtype.name] for t in network.outputs
            ],
            "profiles": [
                {n: [list(s) for s in v] for n, v in p.shapes.items()} for p in config.profiles
            ],
            "flags": [f.name for f in config.flags],
            "detailed": config.profiling_verbosity == ProfilingVerbosity.DETAILED,
        }
        return memoryview(MAGIC + json.dumps(body).encode())


def _describe(t: _Tensor) -> list[Any]:
    return [t.name, list(t.shape), list(t.symbols), t.dtype.name]


def _check_profiles(network: INetworkDefinition, config: IBuilderConfig) -> str:
    dynamic = [t for t in network.inputs if -1 in t.shape]
    if dynamic and not config.profiles:
        return "Error Code 4: Network has dynamic inputs, but no optimization profile is defined"
    for index, profile in enumerate(config.profiles):
        for tensor in network.inputs:
            if tensor.name not in profile.shapes:
                if -1 in tensor.shape:
                    return f"Error Code 4: profile {index} has no shape for {tensor.name}"
                continue
            lo = profile.shapes[tensor.name][0]
            if len(lo) != len(tensor.shape) or any(
                d >= 0 and d != v for d, v in zip(tensor.shape, lo, strict=False)
            ):
                return f"Error Code 4: profile {index} shape of {tensor.name} disagrees"
    return ""


class IEngineInspector:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine

    def get_engine_information(self, fmt: LayerInformationFormat) -> str:
        layers: list[Any]
        if self.engine.body["detailed"]:
            model = onnx.load_from_string(base64.b64decode(self.engine.body["onnx"]))
            layers = [
                {"Name": n.name or n.op_type, "LayerType": n.op_type} for n in model.graph.node
            ]
        else:
            layers = [n for n in ("layer",)]
        return json.dumps({"Layers": layers, "Bindings": [t[0] for t in self.engine.tensors]})


class ICudaEngine:
    def __init__(self, body: dict[str, Any], trt: Any, logger: Any) -> None:
        self.body = body
        self.trt = trt
        self.logger = logger
        self.tensors = [(t, TensorIOMode.INPUT) for t in body["inputs"]] + [
            (t, TensorIOMode.OUTPUT) for t in body["outputs"]
        ]

    @property
    def num_io_tensors(self) -> int:
        return len(self.tensors)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.body["profiles"])

    def _find(self, name: str) -> tuple[list[Any], TensorIOMode]:
        for tensor, mode in self.tensors:
            if tensor[0] == name:
                return tensor, mode
        raise KeyError(name)

    def get_tensor_name(self, index: int) -> str:
        return str(self.tensors[index][0][0])

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self._find(name)[1]

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType[self._find(name)[0][3]]

    def get_tensor_profile_shape(self, name: str, index: int) -> list[tuple[int, ...]]:
        return [tuple(s) for s in self.body["profiles"][index][name]]

    def create_execution_context(self) -> IExecutionContext:
        return IExecutionContext(self)

    def create_engine_inspector(self) -> IEngineInspector:
        return IEngineInspector(self)


class Runtime:
    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.trt = _module_of(self)

    def deserialize_cuda_engine(self, data: Any) -> ICudaEngine | None:
        raw = bytes(data)
        if not raw.startswith(MAGIC):
            _log(self.logger, Severity.ERROR, "Error Code 1: Serialization (magic tag mismatch)")
            return None
        body = json.loads(raw[len(MAGIC) :])
        if body["version"] != self.trt.__version__:
            _log(self.logger, Severity.ERROR, "Error Code 1: Serialization (version mismatch)")
            return None
        return ICudaEngine(body, self.trt, self.logger)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self.profile = 0
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.invalid: set[str] = set()
        self.addresses: dict[str, int] = {}
        self._session: Any = None

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        if not 0 <= index < self.engine.num_optimization_profiles:
            return False
        self.profile = index
        self.shapes.clear()
        return True

    def set_input_shape(self, name: str, shape: Any) -> bool:
        shape = tuple(int(d) for d in shape)
        lo, _, hi = self.engine.body["profiles"][self.profile][name]
        fits = len(shape) == len(lo) and all(
            a <= v <= c for a, v, c in zip(lo, shape, hi, strict=True)
        )
        if not fits:
            _log(
                self.engine.logger,
                Severity.ERROR,
                f"IExecutionContext::setInputShape: Error Code 3: API Usage Error "
                f"({name} dims {list(shape)} outside profile {self.profile})",
            )
            self.invalid.add(name)
            return False
        self.invalid.discard(name)
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        if not ptr:
            return False
        self.addresses[name] = int(ptr)
        return True

    def _symbols(self) -> dict[str, int]:
        found = {}
        for name, _shape, symbols, _dt in self.engine.body["inputs"]:
            if name in self.shapes:
                for sym, v in zip(symbols, self.shapes[name], strict=True):
                    if sym:
                        found[sym] = v
        return found

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        tensor, mode = self.engine._find(name)
        if mode == TensorIOMode.INPUT:
            return self.shapes.get(name, tuple(tensor[1]))
        symbols = self._symbols()
        return tuple(
            d if d >= 0 else symbols.get(sym, -1)
            for d, sym in zip(tensor[1], tensor[2], strict=True)
        )

    def execute_async_v3(self, stream_handle: int) -> bool:
        trt = self.engine.trt
        problems = []
        names = [t[0] for t, _ in self.engine.tensors]
        inputs = [t for t, m in self.engine.tensors if m == TensorIOMode.INPUT]
        problems += [f"{t[0]} shape unset or invalid" for t in inputs if t[0] not in self.shapes]
        problems += [f"{t[0]} invalid" for t in inputs if t[0] in self.invalid]
        problems += [f"{n} has no address" for n in names if n not in self.addresses]
        if trt.execute_failure:
            problems.append(trt.execute_failure)
        if problems:
            _log(self.engine.logger, Severity.ERROR, f"Error Code 3: {'; '.join(problems)}")
            return False
        import onnxruntime

        if self._session is None:
            self._session = onnxruntime.InferenceSession(
                base64.b64decode(self.engine.body["onnx"]), providers=["CPUExecutionProvider"]
            )
        memory = trt.cuda_memory
        feed = {}
        for name, _s, _sym, dtype in self.engine.body["inputs"]:
            shape = self.shapes[name]
            nbytes = int(np.prod(shape)) * np.dtype(_NP[DataType[dtype]]).itemsize
            raw = memory.read(self.addresses[name], nbytes, device=True)
            feed[name] = np.frombuffer(raw, dtype=_NP[DataType[dtype]]).reshape(shape)
        results = self._session.run(None, feed)
        for (name, *_), value in zip(self.engine.body["outputs"], results, strict=True):
            if not memory.write(self.addresses[name], np.ascontiguousarray(value).tobytes()):
                _log(self.engine.logger, Severity.ERROR, f"output {name} overruns its buffer")
                return False
        return True


def _module_of(obj: Any) -> Any:
    return type(obj).__module_ref__  # set per module instance


def make_tensorrt(version: str = "10.13.0") -> types.ModuleType:
    """A fresh stand-in module; "10.x" keeps the precision flags, "11.x" drops them."""
    mod = types.ModuleType("tensorrt")
    mod.__version__ = version  # type: ignore[attr-defined]
    flags = ["TF32", "REFIT", "VERSION_COMPATIBLE"]
    if version.startswith("10"):
        flags += ["FP16", "INT8", "BF16", "OBEY_PRECISION_CONSTRAINTS"]
    mod.BuilderFlag = enum.IntEnum("BuilderFlag", flags)  # type: ignore[attr-defined]
    mod.calls = []  # type: ignore[attr-defined]
    mod.build_failure = ""  # type: ignore[attr-defined]
    mod.execute_failure = ""  # type: ignore[attr-defined]
    mod.cuda_memory = None  # type: ignore[attr-defined]
    for name, value in {
        "ILogger": ILogger,
        "DataType": DataType,
        "nptype": nptype,
        "TensorIOMode": TensorIOMode,
        "MemoryPoolType": MemoryPoolType,
        "ProfilingVerbosity": ProfilingVerbosity,
        "LayerInformationFormat": LayerInformationFormat,
        "OnnxParser": OnnxParser,
    }.items():
        setattr(mod, name, value)
    # Classes that reach their module get per-module subclasses.
    for cls in (Builder, Runtime):
        setattr(mod, cls.__name__, type(cls.__name__, (cls,), {"__module_ref__": mod}))
    return mod


# -- cuda.bindings.runtime --------------------------------------------------------------------


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2


class cudaDeviceAttr(enum.IntEnum):
    cudaDevAttrComputeCapabilityMajor = 75
    cudaDevAttrComputeCapabilityMinor = 76


class cudaStream_t:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __int__(self) -> int:
        return self.handle


class CudaMemory:
    """Device and pinned allocations as host buffers, with bounds-checked copies."""

    def __init__(self, capability: tuple[int, int] = (9, 0)) -> None:
        self.blocks: dict[int, tuple[Any, int, bool]] = {}
        self.streams: set[int] = set()
        self.capability = capability
        self.device_name = "NVIDIA H200"
        self.copies = 0
        #: device memory in all; past it cudaMalloc returns cudaErrorMemoryAllocation
        self.device_capacity_bytes: int | None = None

    def device_bytes(self) -> int:
        return sum(size for _buf, size, device in self.blocks.values() if device)

    def _alloc(self, nbytes: int, device: bool) -> tuple[cudaError_t, int]:
        if nbytes <= 0:
            return cudaError_t.cudaErrorInvalidValue, 0
        capacity = self.device_capacity_bytes
        if device and capacity is not None and self.device_bytes() + nbytes > capacity:
            return cudaError_t.cudaErrorMemoryAllocation, 0
        buf = ctypes.create_string_buffer(nbytes)
        ptr = ctypes.addressof(buf)
        self.blocks[ptr] = (buf, nbytes, device)
        return cudaError_t.cudaSuccess, ptr

    def _block(self, ptr: int, nbytes: int, device: bool) -> bool:
        for start, (_buf, size, is_device) in self.blocks.items():
            if start <= ptr and ptr + nbytes <= start + size and is_device == device:
                return True
        return False

    def read(self, ptr: int, nbytes: int, device: bool) -> bytes:
        if not self._block(ptr, nbytes, device):
            raise ValueError("read outside an allocation")
        return ctypes.string_at(ptr, nbytes)

    def write(self, ptr: int, data: bytes) -> bool:
        if not self._block(ptr, len(data), True):
            return False
        ctypes.memmove(ptr, data, len(data))
        return True

    def module(self) -> types.ModuleType:
        rt = types.ModuleType("cuda.bindings.runtime")
        ok = cudaError_t.cudaSuccess
        bad = cudaError_t.cudaErrorInvalidValue
        rt.cudaError_t = cudaError_t  # type: ignore[attr-defined]
        rt.cudaMemcpyKind = cudaMemcpyKind  # type: ignore[attr-defined]
        rt.cudaDeviceAttr = cudaDeviceAttr  # type: ignore[attr-defined]
        rt.cudaMalloc = lambda n: self._alloc(n, True)  # type: ignore[attr-defined]
        rt.cudaMallocHost = lambda n: self._alloc(n, False)  # type: ignore[attr-defined]

        def free(ptr: int, device: bool) -> tuple[cudaError_t]:
            block = self.blocks.get(ptr)
            if block is None or block[2] != device:
                return (bad,)
            del self.blocks[ptr]
            return (ok,)

        rt.cudaFree = lambda p: free(p, True)  # type: ignore[attr-defined]
        rt.cudaFreeHost = lambda p: free(p, False)  # type: ignore[attr-defined]

        def stream_create() -> tuple[cudaError_t, cudaStream_t]:
            handle = 0x1000 + len(self.streams) + 1
            while handle in self.streams:
                handle += 1
            self.streams.add(handle)
            return ok, cudaStream_t(handle)

        def stream_sync(stream: cudaStream_t) -> tuple[cudaError_t]:
            return (ok,) if int(stream) in self.streams else (bad,)

        def stream_destroy(stream: cudaStream_t) -> tuple[cudaError_t]:
            if int(stream) not in self.streams:
                return (bad,)
            self.streams.discard(int(stream))
            return (ok,)

        def memcpy(dst: int, src: int, n: int, kind: cudaMemcpyKind, stream: Any) -> tuple:
            to_device = kind == cudaMemcpyKind.cudaMemcpyHostToDevice
            if int(stream) not in self.streams:
                return (bad,)
            if not (self._block(src, n, not to_device) and self._block(dst, n, to_device)):
                return (bad,)
            ctypes.memmove(dst, src, n)
            self.copies += 1
            return (ok,)

        rt.cudaStreamCreate = stream_create  # type: ignore[attr-defined]
        rt.cudaStreamSynchronize = stream_sync  # type: ignore[attr-defined]
        rt.cudaStreamDestroy = stream_destroy  # type: ignore[attr-defined]
        rt.cudaMemcpyAsync = memcpy  # type: ignore[attr-defined]
        rt.cudaGetDevice = lambda: (ok, 0)  # type: ignore[attr-defined]
        attr = cudaDeviceAttr
        rt.cudaDeviceGetAttribute = lambda a, d: (  # type: ignore[attr-defined]
            ok,
            self.capability[0]
            if a == attr.cudaDevAttrComputeCapabilityMajor
            else self.capability[1],
        )
        return rt
