"""Champion/challenger experiments wired to the registry: routing, logging, shadow scoring.

The handlers ask `serving_version` which version answers a request and call `record` after
scoring; everything else (challenger scoring, Parquet writing) happens off the hot path. The
experiments file is re-read when it changes, so arms change at run time without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from engines.manifest import Thresholds
from service.batcher import Scored
from service.codec import RowBatch
from service.registry import ModelRegistry, ModelVersion, model_feed
from service.shadow import (
    ExperimentConfig,
    ExperimentLog,
    ExperimentRecord,
    ExperimentRouter,
    Route,
    ShadowJob,
    ShadowRunner,
)
from service.telemetry import Telemetry

__all__ = ["Experiments"]

log = logging.getLogger(__name__)

SHADOW_BUDGET_S = 1.0  # challengers are not on the caller's clock, but must not pile up


class Experiments:
    """The live experiments of one server process."""

    def __init__(
        self,
        registry: ModelRegistry,
        config_path: Path,
        log_prefix: str,
        *,
        max_queued_jobs: int,
        flush_interval_s: float,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._registry = registry
        self._path = config_path
        self._mtime_ns = config_path.stat().st_mtime_ns
        self.router = ExperimentRouter(ExperimentConfig.from_json_file(config_path))
        self.log = ExperimentLog(log_prefix, flush_interval_s=flush_interval_s)
        on_drop = None
        if telemetry is not None:
            metrics = telemetry.metrics

            def on_drop(job: ShadowJob) -> None:
                metrics.count_shadow_drop(job.model)

        self.runner = ShadowRunner(
            self._score_challenger,
            self.log,
            self._thresholds,
            max_queued_jobs=max_queued_jobs,
            on_drop=on_drop,
        )
        self._watcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.log.start()
        self.runner.start()
        self._watcher = asyncio.create_task(self._watch(), name="experiments-watcher")

    async def close(self, timeout_s: float) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.runner.close(timeout_s)
        await asyncio.to_thread(self.log.close, timeout_s)

    def route(self, model: str, entity_id: str) -> Route:
        return self.router.route(model, entity_id)

    def record(
        self,
        route: Route,
        model: ModelVersion,
        request_ids: tuple[str, ...],
        entity_ids: tuple[str, ...],
        rows: RowBatch,
        scored: Scored,
        latency_s: float,
    ) -> None:
        """Log the served arm's rows and queue the shadow copies; never waits."""
        if not route.logged or route.experiment is None or scored.degraded:
            return
        thresholds = model.manifest.thresholds
        for i, (request_id, entity_id) in enumerate(zip(request_ids, entity_ids, strict=True)):
            score = float(scored.scores[i])
            self.log.log(
                ExperimentRecord(
                    request_id=request_id,
                    entity_id=entity_id,
                    experiment=route.experiment,
                    model=model.name,
                    arm=route.arm,
                    version=model.version,
                    score=score,
                    decision=thresholds.decide(score),
                    engine=scored.engine,
                    latency_ms=latency_s * 1e3,
                    mode=route.mode,
                    served=True,
                )
            )
        if route.shadow_versions:
            self.runner.submit(
                ShadowJob(
                    model=model.name,
                    experiment=route.experiment,
                    versions=route.shadow_versions,
                    request_ids=request_ids,
                    entity_ids=entity_ids,
                    inputs=model_feed(model.manifest, rows),
                    champion_scores=np.asarray(scored.scores),
                    champion_version=model.version,
                    mode=route.mode,
                )
            )

    def _thresholds(self, model: str, version: str) -> Thresholds:
        return self._registry.get(model, version).manifest.thresholds

    async def _score_challenger(
        self, model: str, version: str, inputs: Mapping[str, np.ndarray]
    ) -> tuple[np.ndarray, str, float]:
        challenger = self._registry.get(model, version)
        manifest = challenger.manifest
        spec = manifest.history
        rows = RowBatch(
            inputs[manifest.features_input],
            inputs[spec.input] if spec else None,
            inputs[spec.mask_input] if spec else None,
        )
        started = time.perf_counter()
        scored = await challenger.batcher.submit(rows, time.monotonic() + SHADOW_BUDGET_S)
        return scored.scores, scored.engine, time.perf_counter() - started

    async def _watch(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                mtime_ns = self._path.stat().st_mtime_ns
                if mtime_ns == self._mtime_ns:
                    continue
                self.router.update(ExperimentConfig.from_json_file(self._path))
                self._mtime_ns = mtime_ns
                log.info("experiments reloaded from %s", self._path)
            except Exception:
                log.exception("keeping the current experiments: %s is not valid", self._path)
                with contextlib.suppress(OSError):
                    self._mtime_ns = self._path.stat().st_mtime_ns
