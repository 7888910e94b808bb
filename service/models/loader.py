"""Turning a version folder into a servable `ModelVersion`: engines, pool, batcher, warm-up.

Which engines a version gets is the engine factory's choice (`default_engines`: TensorRT plans
where TensorRT runs, validated ONNX variants, ONNX Runtime FP32 as the fallback); the loader
caps the batch at the largest optimization profile, wires the batcher to the pool, measures
the engines' speed where there is a choice, and seeds the engine-time model by running each
batch size once.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from engines.base import Engine, EngineError, EngineFailure, EngineUnavailable
from engines.manifest import Manifest, load_manifest
from engines.onnxrt import OnnxRuntimeEngine
from engines.output import (
    ML_DOMAIN,
    OutputLayoutError,
    ScoreOutput,
    onnx_ml_operators,
    resolve_score_output,
)
from engines.pool import EnginePool
from engines.trt import load_engines
from engines.validation import accepted_variants
from service.batching.batcher import (
    GATHER_S,
    INLINE_MAX_S,
    EngineTimeModel,
    MicroBatcher,
)
from service.batching.rows import RowBatch
from service.errors import Unavailable
from service.models.compute import run_on_pool
from service.models.version import ModelVersion
from service.telemetry import Telemetry

__all__ = ["EngineFactory", "VersionLoader", "batch_cap", "default_engines", "settle_heap"]

log = logging.getLogger(__name__)


EngineFactory = Callable[[Path, Manifest, ScoreOutput], tuple[list[Engine], Engine]]
"""Builds a version's engines (and its fallback) from its folder, its manifest and where the
score is among the outputs (`ScoreOutput`, resolved by the loader once)."""


def default_engines(
    intra_op_threads: int, max_concurrency: int, *, tensorrt: bool, onnx_variants: bool
) -> EngineFactory:
    """TensorRT plans where TensorRT runs, validated ONNX variants, and ONNX Runtime FP32.

    FP32 on ONNX Runtime is both a candidate and the fallback that takes any shape. Only
    variants that `accepted_variants` passes (the manifest's tolerance) are ever loaded.
    """

    def build(path: Path, manifest: Manifest, score: ScoreOutput) -> tuple[list[Engine], Engine]:
        accepted = accepted_variants(path, manifest=manifest)
        fallback = OnnxRuntimeEngine.from_model_dir(
            path,
            manifest,
            intra_op_threads=intra_op_threads,
            max_concurrency=max_concurrency,
            score=score,
        )
        engines: list[Engine] = []
        try:
            if tensorrt:
                engines += _tensorrt_engines(path, manifest, accepted)
            for precision in accepted if onnx_variants else ():
                if precision != "fp32":
                    engines.append(
                        OnnxRuntimeEngine.from_model_dir(
                            path,
                            manifest,
                            precision=precision,
                            intra_op_threads=intra_op_threads,
                            max_concurrency=max_concurrency,
                            score=score,
                        )
                    )
        except BaseException:
            # The caller gets no engines to close: those made before the error are closed here.
            _close_engines((*engines, fallback))
            raise
        if engines:
            engines.append(fallback)
        return engines, fallback

    return build


def _tensorrt_engines(path: Path, manifest: Manifest, accepted: Mapping[str, Path]) -> list[Engine]:
    """The version's TensorRT engines, or none (logged) where they cannot be loaded here."""
    # The graph is read again only where TensorRT plans would be loaded: TensorRT has no
    # layers for classic-ML operators (the loader logs those once, from its own read).
    if len(accepted) < 2 or _ml_operators(path):
        return []
    try:
        return list(load_engines(path, accepted))
    except EngineUnavailable as exc:
        log.info("%s/%s: no TensorRT engines: %s", manifest.name, manifest.version, exc)
    except EngineFailure as exc:
        # CUDA failing here (no device, out of memory) costs the version its TensorRT engines,
        # not its load: ONNX Runtime serves it as on a host without TensorRT.
        log.warning("%s/%s: no TensorRT engines: %s", manifest.name, manifest.version, exc)
    return []


def _close_engines(engines: Iterable[Engine]) -> None:
    """Close each engine once; one that fails to close is logged and the rest still closed."""
    for engine in {id(e): e for e in engines}.values():
        try:
            engine.close()
        except Exception:
            log.exception("closing engine %s failed", engine.name)


def batch_cap(limit: int, manifest: Manifest, engines: Sequence[Engine]) -> int:
    """The most rows one batch may hold: `limit` (the setting), and no more than the largest
    optimization profile of the version's engines, or where none has a profile (ONNX Runtime
    takes any batch), of the manifest's TensorRT profiles."""
    profiled = [e.max_batch_size for e in engines if e.max_batch_size is not None]
    if not profiled:
        profiled = [p.batch[2] for specs in manifest.profiles.values() for p in specs]
    return min(limit, max(profiled)) if profiled else limit


class VersionLoader:
    """Builds `ModelVersion`s with one set of batching settings."""

    def __init__(
        self,
        engine_factory: EngineFactory,
        *,
        max_batch_rows: int,
        max_queue_rows: int,
        workers: int,
        max_queue_delay_s: float,
        inline_max_s: float = INLINE_MAX_S,
        gather_s: float = GATHER_S,
        warmup_iterations: int,
        degrade_on_deadline: bool,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._engine_factory = engine_factory
        self._max_batch_rows = max_batch_rows
        self._max_queue_rows = max_queue_rows
        self._workers = workers
        self._max_queue_delay_s = max_queue_delay_s
        self._inline_max_s = inline_max_s
        self._gather_s = gather_s
        self._warmup_iterations = warmup_iterations
        self._degrade = degrade_on_deadline
        self._telemetry = telemetry

    def build(self, path: Path) -> ModelVersion:
        """Load, calibrate and warm the version in `path` (blocks: run it off the loop)."""
        manifest = load_manifest(path)
        if manifest.version != path.name or manifest.name != path.parent.name:
            raise Unavailable(
                f"{path}: manifest names {manifest.name}/{manifest.version}, "
                f"folder is {path.parent.name}/{path.name}"
            )
        graph = onnx.load(str(path / "model.onnx"), load_external_data=False)
        try:
            score = resolve_score_output(graph, manifest)
        except OutputLayoutError as exc:
            raise Unavailable(f"{path}: {exc}") from exc
        ml_operators = onnx_ml_operators(graph)
        del graph  # the engines hold their own copies
        if ml_operators:
            log.info(
                "%s/%s: ONNX Runtime serves it: TensorRT has no layers for %s (%s)",
                manifest.name,
                manifest.version,
                ", ".join(ml_operators),
                ML_DOMAIN,
            )
        engines, fallback = self._engine_factory(path, manifest, score)
        try:
            return self._assemble(path, manifest, score, engines, fallback)
        except BaseException:
            # A refused version is dropped: its engines' device memory, streams and sessions
            # would otherwise stay allocated for the life of the process.
            _close_engines((*engines, fallback))
            raise

    def _assemble(
        self,
        path: Path,
        manifest: Manifest,
        score: ScoreOutput,
        engines: list[Engine],
        fallback: Engine,
    ) -> ModelVersion:
        """Check the engines' outputs, then wire pool and batcher, calibrate and warm."""
        for engine in {id(e): e for e in (*engines, fallback)}.values():
            _check_output(path, manifest, score, engine)
            if manifest.history is not None and manifest.history.broadcast:
                _check_broadcast(path, manifest, score, engine)
        pool = EnginePool.for_manifest(manifest, engines, fallback)
        precisions = {e.name: e.precision for e in (*engines, fallback)}
        max_rows = batch_cap(self._max_batch_rows, manifest, [*engines, fallback])
        workers = self._workers or max(e.max_concurrency for e in [*engines, fallback])
        time_model = EngineTimeModel()
        batcher = MicroBatcher(
            functools.partial(run_on_pool, manifest, score, pool, precisions),
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
            gather_s=self._gather_s,
        )
        model = ModelVersion(manifest=manifest, path=path, pool=pool, batcher=batcher, score=score)
        if len(pool.engines) > 1:
            sample = _warmup_rows(manifest, 1, _TYPICAL_HISTORY).feed(manifest)
            report = pool.calibrate(sample, sorted({1, 8, max_rows}))
            log.info("%s/%s engines by speed: %s", manifest.name, manifest.version, report.order)
        self._warm(model, time_model, max_rows)
        log.info(
            "loaded %s/%s from %s: score %s, engines %s, fallback %s, batch <= %d, %d workers",
            manifest.name,
            manifest.version,
            path,
            score.describe(),
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
                time_model.observe(time_model.cells(rows, length), outcome.engine_s)


_TYPICAL_HISTORY = 32


def _ml_operators(path: Path) -> tuple[str, ...]:
    return onnx_ml_operators(onnx.load(str(path / "model.onnx"), load_external_data=False))


# Feature rows of the broadcast probe, and how far apart its two forms' scores may be.
_PROBE_ROWS = 3
_PROBE_TOLERANCE = 1e-3


def _check_output(path: Path, manifest: Manifest, score: ScoreOutput, engine: Engine) -> None:
    """Refuse a version whose engine's real output for a probe row does not fit the layout
    resolved from the graph (a dynamic width, a label tensor, a non-finite score). An engine
    that fails on the probe is left to the pool, which serves its batches by the fallback."""
    length = 0
    if manifest.history is not None:
        # A history length the engine's first profile is optimized for, so that any engine
        # takes the probe.
        dims = {s.name: s.dims for s in engine.profiles[0].inputs}.get(manifest.history.input)
        length = dims[1].opt_value if dims is not None and len(dims) > 1 else 1
    probe = _warmup_rows(manifest, 1, length).feed(manifest)
    try:
        outputs = engine.infer(probe)
    except EngineError as exc:
        log.warning("%s: engine %s fails on a probe row: %s", path, engine.name, exc)
        return
    try:
        score.check(outputs, rows=1)
    except OutputLayoutError as exc:
        raise Unavailable(f"{path}: engine {engine.name}: {exc}") from exc


def _broadcast_probe(manifest: Manifest, engine: Engine) -> tuple[int, int] | None:
    """(rows, history length) of a broadcast probe that one of `engine`'s profiles takes both
    with a history batch of one and with that history repeated, None where none does."""
    spec = manifest.history
    assert spec is not None
    for profile in engine.profiles:
        limit = profile.max_batch_size
        # A profile of one row never gets a shared history: the pool sends it one row at a time.
        rows = _PROBE_ROWS if limit is None else min(_PROBE_ROWS, limit)
        length = min(_TYPICAL_HISTORY, spec.max_length)
        dims = {s.name: s.dims for s in profile.inputs}.get(spec.input)
        if dims is not None and len(dims) > 1:
            top = dims[1].max_value
            length = max(dims[1].min_value, length if top is None else min(length, top))
        width = len(spec.fields)
        shared = {
            manifest.features_input: (rows, manifest.n_features),
            spec.input: (1, length, width),
            spec.mask_input: (1, length),
        }
        repeated = {**shared, spec.input: (rows, length, width), spec.mask_input: (rows, length)}
        if rows > 1 and profile.fits(shared) and profile.fits(repeated):
            return rows, length
    return None


def _check_broadcast(path: Path, manifest: Manifest, score: ScoreOutput, engine: Engine) -> None:
    """Refuse a version whose manifest declares `history.broadcast` where `engine` does not
    score several feature rows against a history batch of one as against that history repeated.

    The probe's shapes are taken inside the engine's profiles. An engine none of whose profiles
    takes a shared history is never sent one (the pool serves those batches elsewhere), and one
    that fails on the repeated form is left to the pool, as in `_check_output`.
    """
    spec = manifest.history
    assert spec is not None
    shape = _broadcast_probe(manifest, engine)
    if shape is None:
        log.info("%s: engine %s takes no shared history; broadcast not probed", path, engine.name)
        return
    rows, length = shape
    rng = np.random.default_rng(0)
    features = rng.uniform(0.0, 1.0, (rows, manifest.n_features)).astype(np.float32)
    history = rng.uniform(0.0, 1.0, (1, length, len(spec.fields))).astype(np.float32)
    mask = np.ones((1, length), dtype=np.float32)
    shared = {manifest.features_input: features, spec.input: history, spec.mask_input: mask}
    repeated = {
        manifest.features_input: features,
        spec.input: np.repeat(history, rows, axis=0),
        spec.mask_input: np.repeat(mask, rows, axis=0),
    }
    problem = f"{path}: the manifest declares history.broadcast, but engine {engine.name}"
    try:
        want = score.scores(engine.infer(repeated))
    except EngineError as exc:
        log.warning("%s: engine %s fails on the broadcast probe: %s", path, engine.name, exc)
        return
    try:
        got = score.scores(engine.infer(shared))
    except Exception as exc:
        raise Unavailable(f"{problem} fails on a history batch of 1: {exc}") from exc
    if got.shape != want.shape or not np.allclose(
        got, want, rtol=_PROBE_TOLERANCE, atol=_PROBE_TOLERANCE
    ):
        raise Unavailable(
            f"{problem} scores {rows} rows against one history differently from the "
            f"same history repeated (shapes {got.shape} and {want.shape})"
        )


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
