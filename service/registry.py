"""Loaded models: one `ModelVersion` (manifest, engine pool, batcher) per folder under models/.

``models/<name>/<version>/`` holds ``model.onnx`` and ``manifest.json``; any ONNX model with a
manifest serves. A request that names no version is answered by the model's serving version
(`ModelRegistry.serving_version`): the experiment's champion when an experiment is configured,
else the version pinned in configuration, else the highest loaded. Versions are loaded and
warmed beside what serves; a version reloaded in place is swapped in one step on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from engines.base import Engine, EngineError, EngineUnavailable
from engines.manifest import Manifest, load_manifest
from engines.onnxrt import OnnxRuntimeEngine
from engines.pool import EnginePool
from engines.trt import load_engines
from engines.validation import accepted_variants
from service.batcher import INLINE_MAX_S, BatchOutcome, EngineTimeModel, MicroBatcher
from service.codec import RowBatch
from service.errors import ModelNotFound, ScoringFailed, Unavailable
from service.telemetry import Telemetry

__all__ = [
    "FolderSnapshot",
    "ModelRegistry",
    "ModelVersion",
    "ServingPreference",
    "discover_models",
    "folder_snapshot",
    "version_key",
]

log = logging.getLogger(__name__)


def version_key(version: str) -> tuple[int, int | str]:
    """Numeric versions sort numerically and after any non-numeric ones."""
    return (1, int(version)) if version.isdigit() else (0, version)


def discover_models(models_dir: Path) -> dict[str, list[Path]]:
    """Model name -> version folders (sorted, lowest first) that hold a manifest."""
    found: dict[str, list[Path]] = {}
    if not models_dir.is_dir():
        return found
    for manifest in sorted(models_dir.glob("*/*/manifest.json")):
        version_dir = manifest.parent
        found.setdefault(version_dir.parent.name, []).append(version_dir)
    for versions in found.values():
        versions.sort(key=lambda p: version_key(p.name))
    return found


FolderSnapshot = tuple[tuple[str, int, int], ...]
"""Every file under a folder as (relative path, size in bytes, mtime in ns), sorted."""


def folder_snapshot(folder: Path) -> FolderSnapshot:
    """What a version folder holds now; a file replaced in place changes its size or mtime."""
    entries = []
    for path in sorted(folder.rglob("*")):
        try:
            if path.is_file():
                stat = path.stat()
                entries.append((str(path.relative_to(folder)), stat.st_size, stat.st_mtime_ns))
        except FileNotFoundError:  # removed while the folder was walked
            continue
    return tuple(entries)


@dataclass
class ModelVersion:
    """One servable model version: what the handlers need to score rows."""

    manifest: Manifest
    path: Path
    pool: EnginePool
    batcher: MicroBatcher
    files: FolderSnapshot = ()
    """The folder's files as they were when this version started loading."""

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version

    def engines(self) -> Iterator[Engine]:
        """Every engine of the pool in the order tried, the fallback last, each once."""
        seen = set()
        for engine in (*self.pool.engines, self.pool.fallback):
            if id(engine) not in seen:
                seen.add(id(engine))
                yield engine


def model_feed(manifest: Manifest, rows: RowBatch) -> dict[str, np.ndarray]:
    """The engine inputs for validated rows, named as the model's ONNX inputs."""
    inputs = {manifest.features_input: rows.features}
    spec = manifest.history
    if spec is not None and rows.history is not None and rows.mask is not None:
        inputs[spec.input] = rows.history
        inputs[spec.mask_input] = rows.mask
    return inputs


def run_on_pool(
    manifest: Manifest, pool: EnginePool, precisions: dict[str, str], rows: RowBatch
) -> BatchOutcome:
    """Score merged rows on the engine pool (runs on an engine thread)."""
    started = time.perf_counter()
    try:
        result = pool.run(model_feed(manifest, rows))
    except EngineError as exc:
        raise ScoringFailed("no engine could score the batch") from exc
    engine_s = time.perf_counter() - started
    scores = np.asarray(result.outputs[manifest.output], dtype=np.float32).reshape(-1)
    precision = precisions.get(result.engine_name, "")
    split = len(set(result.row_engines)) > 1
    return BatchOutcome(
        scores,
        result.engine_name,
        result.fallback_reason,
        engine_s,
        precision,
        result.row_engines if split else (),
    )


EngineFactory = Callable[[Path, Manifest], tuple[list[Engine], Engine]]


def default_engines(
    intra_op_threads: int, max_concurrency: int, *, tensorrt: bool, onnx_variants: bool
) -> EngineFactory:
    """TensorRT plans where TensorRT runs, validated ONNX variants, and ONNX Runtime FP32.

    FP32 on ONNX Runtime is both a candidate and the fallback that takes any shape. Only
    variants that `accepted_variants` passes (the manifest's tolerance) are ever loaded.
    """

    def build(path: Path, manifest: Manifest) -> tuple[list[Engine], Engine]:
        accepted = accepted_variants(path, manifest=manifest)
        fallback = OnnxRuntimeEngine.from_model_dir(
            path, manifest, intra_op_threads=intra_op_threads, max_concurrency=max_concurrency
        )
        engines: list[Engine] = []
        if tensorrt and len(accepted) > 1:
            try:
                engines += load_engines(path, accepted)
            except EngineUnavailable as exc:
                log.info("%s/%s: no TensorRT engines: %s", manifest.name, manifest.version, exc)
        if onnx_variants:
            for precision in accepted:
                if precision != "fp32":
                    engines.append(
                        OnnxRuntimeEngine.from_model_dir(
                            path,
                            manifest,
                            precision=precision,
                            intra_op_threads=intra_op_threads,
                            max_concurrency=max_concurrency,
                        )
                    )
        if engines:
            engines.append(fallback)
        return engines, fallback

    return build


class ServingPreference(Protocol):
    """Where the experiments say which version serves (`ExperimentRouter` is one)."""

    def champion(self, model: str) -> str | None: ...

    def versions(self, model: str) -> tuple[str, ...]: ...


class ModelRegistry:
    """The models this process serves, keyed by name, each with a serving version."""

    def __init__(
        self,
        executor: Executor,
        engine_factory: EngineFactory,
        *,
        max_batch_rows: int,
        max_queue_rows: int,
        workers: int,
        max_queue_delay_s: float,
        inline_max_s: float = INLINE_MAX_S,
        warmup_iterations: int,
        degrade_on_deadline: bool,
        telemetry: Telemetry | None = None,
        pinned_versions: Mapping[str, str] | None = None,
    ) -> None:
        self._executor = executor
        self._engine_factory = engine_factory
        self._max_batch_rows = max_batch_rows
        self._max_queue_rows = max_queue_rows
        self._workers = workers
        self._max_queue_delay_s = max_queue_delay_s
        self._inline_max_s = inline_max_s
        self._warmup_iterations = warmup_iterations
        self._degrade = degrade_on_deadline
        self._telemetry = telemetry
        if telemetry is not None:
            telemetry.metrics.set_queue_depth_callback(self.queue_depths)
        self._versions: dict[str, dict[str, ModelVersion]] = {}
        self._highest: dict[str, str] = {}
        self._pinned = dict(pinned_versions or {})
        self._experiments: ServingPreference | None = None
        self._reload_listeners: list[Callable[[str, str], None]] = []
        self.ready = False

    def follow(self, experiments: ServingPreference) -> None:
        """Serve each model's experiment champion to requests that name no version."""
        self._experiments = experiments

    def on_reload(self, listener: Callable[[str, str], None]) -> None:
        """Call `listener(name, version)` whenever a loaded version is swapped for new files."""
        self._reload_listeners.append(listener)

    # -- lookups (event loop) -------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._versions)

    def versions(self, name: str) -> list[str]:
        return sorted(self._versions.get(name, {}), key=version_key)

    def preferred_version(self, name: str) -> tuple[str, str] | None:
        """The version configuration names to serve `name`, and which setting names it."""
        if self._experiments is not None:
            champion = self._experiments.champion(name)
            if champion is not None:
                return champion, "the experiment's champion"
        pinned = self._pinned.get(name)
        return None if pinned is None else (pinned, "pinned in the settings")

    def serving_version(self, name: str) -> str:
        """The version that answers requests naming none: champion, else pinned, else highest.

        A configured version that is not loaded is an error (UNAVAILABLE), never a reason to
        serve another: the highest may be a challenger.
        """
        versions = self._versions.get(name)
        if not versions:
            raise ModelNotFound(f"model {name!r} is not loaded")
        preferred = self.preferred_version(name)
        if preferred is None:
            return self._highest[name]
        version, why = preferred
        if version not in versions:
            raise Unavailable(f"model {name!r}: version {version!r} ({why}) is not loaded")
        return version

    def in_use(self, name: str) -> set[str]:
        """Versions of `name` that must stay loaded: what serves and what configuration names."""
        held = set(self._experiments.versions(name)) if self._experiments is not None else set()
        if name in self._pinned:
            held.add(self._pinned[name])
        if name in self._highest and self.preferred_version(name) is None:
            held.add(self._highest[name])
        return held

    def get(self, name: str, version: str = "") -> ModelVersion:
        """`version` of model `name`; its serving version when `version` is empty."""
        versions = self._versions.get(name)
        if not versions:
            raise ModelNotFound(f"model {name!r} is not loaded")
        try:
            return versions[version or self.serving_version(name)]
        except KeyError:
            raise ModelNotFound(f"model {name!r} has no version {version!r} loaded") from None

    def queue_depths(self) -> dict[tuple[str, str], int]:
        """Rows waiting per (model, version), read by the queue-depth gauge."""
        return {(m.name, m.version): m.batcher.queued_rows for m in list(self.all())}

    def all(self) -> Iterator[ModelVersion]:
        for versions in self._versions.values():
            yield from versions.values()

    # -- loading ------------------------------------------------------------------------

    async def load_dir(self, models_dir: Path) -> None:
        """Load every model version found under `models_dir`."""
        found = discover_models(models_dir)
        if not found:
            raise Unavailable(f"no model with a manifest.json under {models_dir}")
        for versions in found.values():
            for path in versions:
                await self.load(path)
        for name in self.names():
            try:
                log.info("%s: version %s serves", name, self.serving_version(name))
            except Unavailable as exc:
                log.error("%s; requests naming no version fail until it is", exc)
        self.ready = True

    async def load(self, path: Path) -> ModelVersion:
        """Load and warm a version folder not loaded yet; it serves only as the rule says."""
        if path.name in self._versions.get(path.parent.name, {}):
            raise ValueError(f"{path.parent.name} version {path.name} is loaded; reload it")
        model = await self._load(path)
        self._versions.setdefault(model.name, {})[model.version] = model
        self._update_highest(model.name)
        return model

    async def reload(self, path: Path, drain_s: float) -> ModelVersion:
        """Load a loaded version's changed files beside it, swap them in, retire the old.

        Requests that hold the old instance finish on it; if the new files do not load, the
        error propagates and the old instance serves on.
        """
        name, version = path.parent.name, path.name
        old = self.get(name, version)
        model = await self._load(path)
        self._versions[name][version] = model  # one step on the event loop
        for listener in self._reload_listeners:
            listener(name, version)
        await self._retire(old, drain_s)
        return model

    async def unload(self, name: str, version: str, drain_s: float) -> None:
        """Drain and drop a version that neither serves nor is named by configuration."""
        if version in self.in_use(name):
            raise ValueError(f"{name} {version} serves or is configured; it stays loaded")
        model = self._versions[name].pop(version)
        if self._versions[name]:
            self._update_highest(name)
        else:
            del self._versions[name], self._highest[name]
        await self._retire(model, drain_s)

    async def _load(self, path: Path) -> ModelVersion:
        files = folder_snapshot(path)  # before reading: a change during the load shows later
        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(self._executor, self._build, path)
        model.files = files
        settle_heap()
        model.batcher.start()
        return model

    def _update_highest(self, name: str) -> None:
        self._highest[name] = max(self._versions[name], key=version_key)

    @staticmethod
    async def _retire(model: ModelVersion, drain_s: float) -> None:
        # Requests that looked `model` up in this turn of the event loop (a split batch submits
        # from tasks that start on the next turn) are queued before its batcher stops admitting.
        await asyncio.sleep(0)
        await model.batcher.close(drain_s)
        for engine in model.engines():
            engine.close()

    async def close(self, drain_s: float) -> None:
        await asyncio.gather(*(m.batcher.close(drain_s) for m in self.all()))
        for model in self.all():
            for engine in model.engines():
                engine.close()

    def _build(self, path: Path) -> ModelVersion:
        manifest = load_manifest(path)
        if manifest.version != path.name or manifest.name != path.parent.name:
            raise Unavailable(
                f"{path}: manifest names {manifest.name}/{manifest.version}, "
                f"folder is {path.parent.name}/{path.name}"
            )
        engines, fallback = self._engine_factory(path, manifest)
        pool = EnginePool.for_manifest(manifest, engines, fallback)
        precisions = {e.name: e.precision for e in (*engines, fallback)}
        max_rows = min(self._max_batch_rows, manifest.max_batch_size)
        workers = self._workers or max(e.max_concurrency for e in [*engines, fallback])
        time_model = EngineTimeModel()
        batcher = MicroBatcher(
            functools.partial(run_on_pool, manifest, pool, precisions),
            max_batch_rows=max_rows,
            max_queue_rows=self._max_queue_rows,
            workers=workers,
            max_queue_delay_s=self._max_queue_delay_s,
            time_model=time_model,
            degrade_on_deadline=self._degrade,
            telemetry=self._telemetry,
            labels=(manifest.name, manifest.version),
            # A call that can hang must not hold the event loop: then every batch goes to the
            # engine threads.
            inline_max_s=0.0
            if any(e.can_hang for e in (*engines, fallback))
            else self._inline_max_s,
        )
        model = ModelVersion(manifest=manifest, path=path, pool=pool, batcher=batcher)
        if len(pool.engines) > 1:
            sample = model_feed(manifest, _warmup_rows(manifest, 1, _TYPICAL_HISTORY))
            report = pool.calibrate(sample, sorted({1, 8, max_rows}))
            log.info("%s/%s engines by speed: %s", manifest.name, manifest.version, report.order)
        self._warm(model, time_model, max_rows)
        log.info(
            "loaded %s/%s from %s: engines %s, fallback %s, batch <= %d, %d workers",
            manifest.name,
            manifest.version,
            path,
            [e.name for e in pool.engines],
            fallback.name,
            max_rows,
            workers,
        )
        return model

    def _warm(self, model: ModelVersion, time_model: EngineTimeModel, max_rows: int) -> None:
        """Run each power-of-two batch size to seed the engine-time model."""
        manifest = model.manifest
        length = min(_TYPICAL_HISTORY, manifest.history.max_length) if manifest.history else 0
        sizes = sorted(
            {1, max_rows, *(2**k for k in range(max_rows.bit_length()) if 2**k <= max_rows)}
        )
        for _ in range(self._warmup_iterations):
            for rows in sizes:
                batch = _warmup_rows(manifest, rows, length)
                outcome = model.batcher.run_batch(batch)
                time_model.observe(rows, length, outcome.engine_s)


_TYPICAL_HISTORY = 32


def settle_heap() -> None:
    """Collect once, then put every object alive now out of the cyclic collector's reach.

    A full collection of a loaded server's heap (about 110,000 tracked objects: ONNX Runtime,
    protobuf, OpenTelemetry, the model) takes about 50 ms on the development machine, and
    CPython runs one whenever enough objects have survived: a 50 ms stall of the event loop,
    five times the budget. Frozen objects (`gc.freeze`) are skipped by every later
    collection, so those stay under a millisecond; what requests allocate is collected as
    before. Called after each model load; the first call pays the one full collection, before
    the server takes traffic. A version unloaded later is freed by reference counting; a
    reference cycle inside it would stay (its objects are frozen).
    """
    gc.collect()
    gc.freeze()


def _warmup_rows(manifest: Manifest, rows: int, length: int) -> RowBatch:
    features = np.zeros((rows, manifest.n_features), dtype=np.float32)
    if manifest.history is None:
        return RowBatch(features, None, None)
    history = np.zeros((rows, max(length, 1), len(manifest.history.fields)), dtype=np.float32)
    mask = np.ones((rows, max(length, 1)), dtype=np.float32)
    return RowBatch(features, history, mask)
