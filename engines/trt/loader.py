"""Model-folder level: build the plans a model needs, and load the ones that match this host."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx

from engines.base import EngineUnavailable
from engines.manifest import Manifest, load_manifest
from engines.output import ML_DOMAIN, onnx_ml_operators
from engines.trt.build import build_plan, repeat_profiles
from engines.trt.cuda import CudaRuntime
from engines.trt.engine import TensorRTEngine
from engines.trt.lib import import_tensorrt
from engines.trt.logger import make_logger
from engines.trt.plans import BuildRecord, PlanKey, PlanRefused, PlanStore, sha256_file

__all__ = ["build_engines", "current_key", "load_engines"]

log = logging.getLogger(__name__)

DEFAULT_WORKSPACE_BYTES = 1 << 30


def _onnx_for(manifest: Manifest, model_dir: Path, precision: str) -> Path:
    if precision == "fp32":
        return model_dir / "model.onnx"
    if precision not in manifest.variants:
        raise EngineUnavailable(
            f"{manifest.name} v{manifest.version} has no {precision} ONNX variant; "
            "run python -m engines.precision first"
        )
    return model_dir / manifest.variants[precision]


def current_key(trt: Any, cuda: CudaRuntime, onnx_path: Path, precision: str) -> PlanKey:
    """The key a plan for `onnx_path` must carry to load on this GPU and TensorRT."""
    return PlanKey(
        precision=precision,
        compute_capability=cuda.compute_capability(),
        tensorrt_version=str(trt.__version__),
        onnx_sha256=sha256_file(onnx_path),
    )


def _timing_cache_path(store: PlanStore, key: PlanKey) -> Path:
    """The timing cache for plans of `key`'s GPU and TensorRT version, keyed as plan files are:
    TensorRT refuses a cache made on another device or version."""
    sm = key.compute_capability.replace(".", "")
    return store.folder / f"timing.sm{sm}.trt{key.tensorrt_version}.cache"


def _history_inputs(manifest: Manifest) -> tuple[str, ...]:
    hist = manifest.history
    return (hist.input, hist.mask_input) if hist else ()


def build_engines(
    model_dir: Path,
    precisions: Sequence[str] = ("fp16", "int8"),
    *,
    contexts: int = 2,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    rebuild: bool = False,
    cuda: CudaRuntime | None = None,
) -> list[Path]:
    """Build (or keep, when current) one plan per precision under ``<model_dir>/engines``.

    Raises `EngineUnavailable` ("TensorRT is not installed: ...") on a host without TensorRT,
    and for a model of classic-ML operators (tree ensembles, linear classifiers), which
    TensorRT has no layers for.
    """
    model_dir = Path(model_dir)
    manifest = load_manifest(model_dir)
    ml_operators = onnx_ml_operators(onnx.load(str(model_dir / "model.onnx")))
    if ml_operators:
        raise EngineUnavailable(
            f"{manifest.name}/{manifest.version}: TensorRT has no layers for "
            f"{', '.join(ml_operators)} ({ML_DOMAIN}); ONNX Runtime serves this model"
        )
    trt = import_tensorrt()
    cuda = cuda or CudaRuntime()
    store = PlanStore(model_dir)
    store.folder.mkdir(parents=True, exist_ok=True)
    logger = make_logger(trt)
    built = []
    for precision in precisions:
        onnx_path = _onnx_for(manifest, model_dir, precision)
        specs = manifest.profiles.get(precision) or manifest.profiles.get("fp32")
        if not specs:
            raise EngineUnavailable(f"manifest has no TensorRT profiles for {precision}")
        key = current_key(trt, cuda, onnx_path, precision)
        if not rebuild:
            try:
                store.load(key)
                log.info("plan %s is current", key.stem)
                built.append(store.plan_path(key))
                continue
            except PlanRefused as exc:
                log.info("building %s: %s", precision, exc)
        logger.clear()
        profiles = repeat_profiles(specs, contexts)
        result = build_plan(
            onnx_path,
            profiles,
            workspace_bytes,
            _timing_cache_path(store, key),
            precision,
            logger,
            history_inputs=_history_inputs(manifest),
        )
        record = BuildRecord(
            key=key,
            onnx_file=onnx_path.name,
            plan_sha256=_sha256_bytes(result.plan),
            profiles=tuple(
                {"batch": list(p.batch), "history_length": _opt_list(p.history_length)}
                for p in profiles
            ),
            workspace_bytes=workspace_bytes,
            build_seconds=round(result.build_seconds, 3),
            flags=result.flags,
        )
        built.append(store.save(record, result.plan, result.inspector_json))
        log.info("built %s in %.1f s", key.stem, result.build_seconds)
    return built


def _sha256_bytes(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _opt_list(value: tuple[int, int, int] | None) -> list[int] | None:
    return list(value) if value is not None else None


def load_engines(
    model_dir: Path,
    accepted: Mapping[str, Path],
    precisions: Sequence[str] = ("fp16", "int8"),
    *,
    rebuild_stale: bool = False,
    cuda: CudaRuntime | None = None,
) -> list[TensorRTEngine]:
    """TensorRT engines for the precisions validation accepted and whose plans match here.

    `accepted` is `engines.validation.accepted_variants(...)`: a precision missing there is
    never loaded. A stale or foreign plan is rebuilt when `rebuild_stale`, else skipped with a
    logged reason; the caller's pool then serves those shapes from ONNX Runtime. An error while
    loading one precision (`EngineUnavailable`, or `EngineFailure` from CUDA) closes the engines
    already loaded before it propagates.
    """
    trt = import_tensorrt()
    cuda = cuda or CudaRuntime()
    model_dir = Path(model_dir)
    store = PlanStore(model_dir)
    engines: list[TensorRTEngine] = []
    try:
        for precision in precisions:
            if precision not in accepted:
                log.warning("not loading tensorrt-%s: refused or not validated", precision)
                continue
            key = current_key(trt, cuda, accepted[precision], precision)
            try:
                plan = store.load(key)
            except PlanRefused as exc:
                if not rebuild_stale:
                    log.warning("not loading tensorrt-%s: %s", precision, exc)
                    continue
                build_engines(model_dir, [precision], rebuild=True, cuda=cuda)
                plan = store.load(key)
            engines.append(TensorRTEngine(plan, precision=precision, cuda=cuda))
    except Exception:
        # The caller never sees the list, so nothing else would free these engines' device
        # and pinned buffers and their streams.
        for engine in engines:
            engine.close()
        raise
    return engines
