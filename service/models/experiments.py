"""Champion/challenger experiments wired to the registry: routing, logging, shadow scoring.

`service.models.routing.RequestRouter` asks `route` which arm answers each request row and calls
`record` after scoring; everything else happens off the hot path: the served records are
written by a log thread, and challengers score in a separate lowest-priority process
(`ShadowRunner`). The registry follows the router: each model's champion is its serving
version. The experiments file is re-read when it changes, so arms change at run time without a
restart, and the registry then checks again that each model's serving version is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np

from service.batching.batcher import Scored
from service.batching.rows import RowBatch
from service.explanations.reasons import Explained
from service.models.registry import ModelRegistry, ModelVersion
from service.shadow import (
    ExperimentConfig,
    ExperimentLog,
    ExperimentRecord,
    ExperimentRouter,
    Route,
    ShadowJob,
    ShadowRunner,
)
from service.shadow.log import DEFAULT_MAX_FILE_AGE_S, DEFAULT_MAX_FILE_BYTES
from service.shadow.runner import MIN_SAMPLED_SHARE, sampled
from service.telemetry import Telemetry

__all__ = ["Experiments"]

log = logging.getLogger(__name__)


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
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_file_age_s: float = DEFAULT_MAX_FILE_AGE_S,
        pass_interval_s: float = 0.1,
        min_sampled_share: float = MIN_SAMPLED_SHARE,
        shadow_cpus: Collection[int] = (),
        telemetry: Telemetry | None = None,
    ) -> None:
        self._registry = registry
        self._path = config_path
        self._mtime_ns = config_path.stat().st_mtime_ns
        self.router = ExperimentRouter(ExperimentConfig.from_json_file(config_path))
        registry.follow(self.router)
        self.log = ExperimentLog(
            log_prefix,
            flush_interval_s=flush_interval_s,
            max_file_bytes=max_file_bytes,
            max_file_age_s=max_file_age_s,
        )
        rolling = {"max_file_bytes": max_file_bytes, "max_file_age_s": max_file_age_s}
        self._metrics = telemetry.metrics if telemetry is not None else None
        # The worker process writes the challenger records as a replica of its own.
        self.runner = ShadowRunner(
            self._version_dir,
            log_prefix,
            replica_id=f"{self.log.replica_id}-shadow",
            flush_interval_s=flush_interval_s,
            log_rolling=rolling,
            max_queued_jobs=max_queued_jobs,
            pass_interval_s=pass_interval_s,
            min_sampled_share=min_sampled_share,
            cpus=shadow_cpus,
        )
        registry.on_reload(self.runner.forget)  # the worker must score the new files too
        if self._metrics is not None:
            self._metrics.set_shadow_share_callback(lambda: self.runner.sampled_share)
        self._watcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._warn_unloaded()
        self.log.start()
        self.runner.start()
        self._watcher = asyncio.create_task(self._watch(), name="experiments-watcher")

    async def close(self, timeout_s: float) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.runner.close(timeout_s)
        self._publish_drops()
        self.runner.log_drops(now_or_never=True)
        await asyncio.to_thread(self.log.close, timeout_s)

    def roll(self) -> None:
        """Publish the open log files of the server and its shadow worker now (SIGUSR1), so a
        report sees every record accepted so far; never waits."""
        log.info("rolling the experiment log files")
        self.log.roll()
        self.runner.roll()

    def route(self, model: str, entity_id: str) -> Route:
        return self.router.route(model, entity_id)

    def record(
        self,
        model: ModelVersion,
        routes: Sequence[Route | None],
        request_ids: Sequence[str],
        entity_ids: Sequence[str],
        rows: RowBatch,
        scored: Scored,
        latency_s: float,
        explained: Explained | None = None,
    ) -> None:
        """Log each routed row that `model` answered and queue its shadow copy; never waits.

        `routes[i]` is row i's route (None: outside the experiment, not logged). Rows that
        share a route and have challengers to shadow go to the shadow worker as one job.
        `explained` (a one-row request that asked for reasons): the served codes are logged,
        and the shadow job asks the worker to explain the challengers the same way.
        """
        if explained is not None and len(routes) != 1:
            raise ValueError("reasons are logged for one-row requests only")
        if scored.degraded:
            return
        thresholds = model.manifest.thresholds
        latency_ms = latency_s * 1e3
        shadowed: dict[Route, list[int]] = {}
        for i, route in enumerate(routes):
            if route is None or route.experiment is None:
                continue
            score = float(scored.scores[i])
            self.log.log(
                ExperimentRecord(
                    request_id=request_ids[i],
                    entity_id=entity_ids[i],
                    experiment=route.experiment,
                    model=model.name,
                    arm=route.arm,
                    version=model.version,
                    score=score,
                    decision=thresholds.decide(score),
                    engine=scored.row_engine(i)[0],
                    latency_ms=latency_ms,
                    mode=route.mode,
                    served=True,
                    reason_codes=explained.codes if explained is not None else (),
                )
            )
            if route.shadow_versions:
                shadowed.setdefault(route, []).append(i)
        for route, positions in shadowed.items():
            self._shadow(route, model, positions, request_ids, entity_ids, rows, scored, explained)

    def _shadow(
        self,
        route: Route,
        model: ModelVersion,
        positions: list[int],
        request_ids: Sequence[str],
        entity_ids: Sequence[str],
        rows: RowBatch,
        scored: Scored,
        explained: Explained | None,
    ) -> None:
        assert route.experiment is not None
        reason = self.runner.full_reason
        if reason:
            self.runner.drop(model.name, reason=reason)  # all a full queue costs the champion
            return
        share = self.runner.sampled_share
        if share < 1.0:  # the worker fell behind: a deterministic share of the entities
            positions = [
                i for i in positions if sampled(share, model.name, entity_ids[i], request_ids[i])
            ]
            if not positions:
                return
        whole = len(positions) == len(request_ids)
        inputs = rows.feed(model.manifest)
        scores = np.asarray(scored.scores)
        if not whole:
            index = np.asarray(positions, dtype=np.intp)
            inputs = {name: array[index] for name, array in inputs.items()}
            scores = scores[index]
        self.runner.submit(
            ShadowJob(
                model=model.name,
                experiment=route.experiment,
                versions=route.shadow_versions,
                request_ids=tuple(request_ids[i] for i in positions),
                entity_ids=tuple(entity_ids[i] for i in positions),
                inputs=inputs,
                champion_scores=scores,
                champion_version=model.version,
                mode=route.mode,
                explain_top_k=explained.top_k if explained is not None else 0,
                explain_when=explained.when if explained is not None else "always",
            )
        )

    def _warn_unloaded(self) -> None:
        for model, experiment in self.router.config.models.items():
            missing = [
                v
                for v in (experiment.champion, *experiment.challengers)
                if v not in self._registry.versions(model)
            ]
            if missing:
                log.error("experiment of %s names versions not loaded: %s", model, missing)

    def _version_dir(self, model: str, version: str) -> Path:
        return self._registry.get(model, version).path

    def _publish_drops(self) -> None:
        # Counted as plain ints when dropped; published here, one add per model.
        if self._metrics is None:
            return
        for model, jobs in self.runner.take_drops().items():
            self._metrics.count_shadow_drop(model, jobs)

    async def _watch(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self._publish_drops()
            self.runner.log_drops()
            self.runner.adjust_share()  # also when no job comes to move it
            try:
                mtime_ns = self._path.stat().st_mtime_ns
                if mtime_ns == self._mtime_ns:
                    continue
                self.router.update(ExperimentConfig.from_json_file(self._path))
                self._mtime_ns = mtime_ns
                log.info("experiments reloaded from %s", self._path)
                self._warn_unloaded()
            except Exception as exc:
                log.error("keeping the current experiments: %s", exc)
                log.debug("the experiments file could not be used", exc_info=True)
                with contextlib.suppress(OSError):
                    self._mtime_ns = self._path.stat().st_mtime_ns
                continue
            await self._registry.check_readiness()  # the champions may have changed
