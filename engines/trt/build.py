"""ONNX to TensorRT plan, for TensorRT 10.x and 11.

TensorRT 11 builds only strongly typed networks: precision comes from the ONNX file (FP16 from
the converted model, INT8 from Q/DQ nodes) and the precision builder flags are gone. TensorRT
10 still has the flags, and they are set there only. One optimization profile is added per
concurrent execution context, since a context in use owns its profile.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.base import EngineFailure
from engines.manifest import ProfileSpec
from engines.trt.lib import import_tensorrt

__all__ = [
    "BuiltPlan",
    "PlanBuildError",
    "ShapeRange",
    "build_plan",
    "precision_flags",
    "profile_shapes",
    "repeat_profiles",
]

log = logging.getLogger(__name__)


class PlanBuildError(EngineFailure):
    """TensorRT could not parse the ONNX file or build a plan from it."""


@dataclass(frozen=True, slots=True)
class ShapeRange:
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BuiltPlan:
    plan: bytes
    inspector_json: str | None
    build_seconds: float
    flags: tuple[str, ...]


def repeat_profiles(specs: Sequence[ProfileSpec], contexts: int) -> tuple[ProfileSpec, ...]:
    """N copies of the manifest's profiles, one set per concurrent execution context."""
    if contexts < 1:
        raise ValueError("contexts must be >= 1")
    return tuple(specs) * contexts


def profile_shapes(
    inputs: Sequence[tuple[str, tuple[int, ...]]],
    spec: ProfileSpec,
    history_inputs: Collection[str],
) -> dict[str, ShapeRange]:
    """Min/opt/max shapes of every network input for one profile.

    Axis 0 is the batch; axis 1 of a history input is its length. Any other dynamic axis has
    no range in the manifest, which is an error rather than a guess.
    """
    shapes = {}
    for name, dims in inputs:
        lo, mid, hi = [], [], []
        for axis, dim in enumerate(dims):
            if dim >= 0:
                rng: tuple[int, int, int] = (dim, dim, dim)
            elif axis == 0:
                rng = spec.batch
            elif axis == 1 and name in history_inputs:
                if spec.history_length is None:
                    raise PlanBuildError(f"input {name!r} has a dynamic length, the profile none")
                rng = spec.history_length
            else:
                raise PlanBuildError(f"input {name!r} axis {axis} is dynamic with no range")
            if not rng[0] <= rng[1] <= rng[2]:
                raise PlanBuildError(f"profile range {rng} for {name!r} is not min <= opt <= max")
            lo.append(rng[0])
            mid.append(rng[1])
            hi.append(rng[2])
        shapes[name] = ShapeRange(tuple(lo), tuple(mid), tuple(hi))
    return shapes


def precision_flags(trt: Any, precision: str) -> tuple[str, ...]:
    """Builder flags for `precision` on this TensorRT; none on TensorRT 11 (strong typing)."""
    if precision == "fp32" or not hasattr(trt.BuilderFlag, "FP16"):
        return ()
    if precision == "fp16":
        return ("FP16",)
    if precision == "int8":
        # Layers left outside the Q/DQ pairs may still run in FP16.
        return ("INT8", "FP16")
    raise ValueError(f"unknown precision {precision!r}")


def _parse(trt: Any, builder: Any, onnx_path: Path, logger: Any) -> tuple[Any, Any]:
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise PlanBuildError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    return network, parser


def _read_timing_cache(config: Any, path: Path | None) -> None:
    data = path.read_bytes() if path is not None and path.exists() else b""
    if data:
        try:
            cache = config.create_timing_cache(data)
            accepted = cache is not None and config.set_timing_cache(cache, False)
        except RuntimeError:  # not a timing cache TensorRT can read (truncated, foreign)
            accepted = False
        if accepted:
            return
        # A cache is specific to the device and TensorRT version (two GPUs of one compute
        # capability differ too): timings from another would not fit this one. The build
        # times afresh, and its cache replaces the refused one.
        log.warning("TensorRT refused the timing cache %s; building without its timings", path)
    if not config.set_timing_cache(config.create_timing_cache(b""), False):
        raise PlanBuildError("TensorRT refused an empty timing cache")


def _write_timing_cache(config: Any, path: Path | None) -> None:
    if path is None:
        return
    data = bytes(config.get_timing_cache().serialize())
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _inspect(trt: Any, plan: bytes, logger: Any) -> str | None:
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise PlanBuildError(f"the new plan does not deserialize: {logger.recent_errors()}")
    inspector = engine.create_engine_inspector()
    return str(inspector.get_engine_information(trt.LayerInformationFormat.JSON))


def build_plan(
    onnx_path: Path,
    profiles: Sequence[ProfileSpec],
    workspace_bytes: int,
    timing_cache_path: Path | None,
    precision: str,
    logger: Any,
    *,
    history_inputs: Collection[str] = ("history", "history_mask"),
) -> BuiltPlan:
    """Parse `onnx_path` and build a serialized plan with one profile per entry of `profiles`.

    `logger` is a `make_logger(trt)` logger; a failed build raises `PlanBuildError` carrying its
    recent error messages. The timing cache at `timing_cache_path` is read first and saved after;
    one TensorRT refuses (made on another device or TensorRT version) is replaced, with a WARNING.
    """
    trt = import_tensorrt()
    start = time.perf_counter()
    builder = trt.Builder(logger)
    network, _parser = _parse(trt, builder, Path(onnx_path), logger)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    flags = precision_flags(trt, precision)
    for flag in flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    inputs = []
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        inputs.append((tensor.name, tuple(int(d) for d in tensor.shape)))
    for spec in profiles:
        profile = builder.create_optimization_profile()
        for name, rng in profile_shapes(inputs, spec, history_inputs).items():
            profile.set_shape(name, rng.min, rng.opt, rng.max)
        if config.add_optimization_profile(profile) < 0:
            raise PlanBuildError(f"TensorRT refused profile {spec}: {logger.recent_errors()}")
    _read_timing_cache(config, timing_cache_path)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise PlanBuildError(
            f"TensorRT could not build {Path(onnx_path).name} ({precision}): "
            f"{logger.recent_errors()}"
        )
    data = bytes(plan)
    _write_timing_cache(config, timing_cache_path)
    inspector_json = _inspect(trt, data, logger)
    return BuiltPlan(data, inspector_json, time.perf_counter() - start, flags)
