"""`ShadowRunner`: score challengers on copies of served requests, off the hot path.

The handler calls `submit` (non-blocking, never awaits); a small fixed set of worker tasks
takes jobs from a bounded queue, awaits the injected `score_fn` for each challenger version,
and logs one challenger record per row. A full queue drops the job and counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from engines.manifest import Thresholds
from service.shadow.log import ExperimentLog
from service.shadow.record import ExperimentRecord

__all__ = ["ScoreFn", "ShadowJob", "ShadowRunner"]

_log = logging.getLogger(__name__)

ScoreFn = Callable[[str, str, Mapping[str, np.ndarray]], Awaitable[tuple[np.ndarray, str, float]]]
"""``score_fn(model, version, inputs) -> (scores, engine_name, latency_s)``; one score per row."""


@dataclass(frozen=True, slots=True)
class ShadowJob:
    """One served request (or batch) to score again with the challenger versions.

    `inputs` hold the already-validated arrays, batch dimension first, one row per
    `request_ids` entry; `champion_scores` are what `champion_version` served, row by row.
    """

    model: str
    experiment: str
    versions: tuple[str, ...]
    request_ids: tuple[str, ...]
    entity_ids: tuple[str, ...]
    inputs: Mapping[str, np.ndarray]
    champion_scores: np.ndarray
    champion_version: str
    mode: Literal["shadow", "ab"] = "shadow"

    def __post_init__(self) -> None:
        rows = len(self.request_ids)
        if len(self.entity_ids) != rows or len(self.champion_scores) != rows:
            raise ValueError("request_ids, entity_ids and champion_scores must align")


class ShadowRunner:
    """Bounded queue plus `workers` tasks; counters are plain ints read by metrics."""

    def __init__(
        self,
        score_fn: ScoreFn,
        log: ExperimentLog,
        thresholds_for: Callable[[str, str], Thresholds],
        *,
        max_queued_jobs: int = 1024,
        workers: int = 1,
        on_drop: Callable[[ShadowJob], None] | None = None,
    ) -> None:
        if max_queued_jobs <= 0 or workers <= 0:
            raise ValueError("max_queued_jobs and workers must be positive")
        self._score_fn = score_fn
        self._log = log
        self._thresholds_for = thresholds_for
        self._on_drop = on_drop
        self._queue: asyncio.Queue[ShadowJob] = asyncio.Queue(maxsize=max_queued_jobs)
        self._workers_wanted = workers
        self._tasks: list[asyncio.Task[None]] = []
        self._accepting = False
        self.submitted = 0
        self.dropped = 0
        self.completed = 0
        self.failed = 0
        self.decision_flips = 0

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        """Start the workers; call from inside the running event loop."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._work(), name=f"shadow-worker-{i}")
            for i in range(self._workers_wanted)
        ]
        self._accepting = True

    def submit(self, job: ShadowJob) -> bool:
        """Queue a job without waiting; False (counted, `on_drop` called) when full or closed."""
        if self._accepting:
            try:
                self._queue.put_nowait(job)
                self.submitted += 1
                return True
            except asyncio.QueueFull:
                pass
        self.dropped += 1
        if self._on_drop is not None:
            self._on_drop(job)
        return False

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let the workers drain the queue for up to `timeout_s`, then cancel.

        Jobs still queued when the time is up are counted as dropped.
        """
        self._accepting = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), timeout_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        while not self._queue.empty():
            self._queue.get_nowait()
            self._queue.task_done()
            self.dropped += 1

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._score(job)
            except asyncio.CancelledError:
                raise
            except Exception:  # a challenger failure must never surface anywhere else
                self.failed += 1
                _log.exception("shadow scoring of %s failed", job.model)
            else:
                self.completed += 1
            finally:
                self._queue.task_done()

    async def _score(self, job: ShadowJob) -> None:
        champion = self._thresholds_for(job.model, job.champion_version)
        for version in job.versions:
            scores, engine, latency_s = await self._score_fn(job.model, version, job.inputs)
            thresholds = self._thresholds_for(job.model, version)
            rows = np.asarray(scores, dtype=np.float64).reshape(-1)
            self._log_rows(job, version, rows, engine, latency_s * 1e3, thresholds, champion)

    def _log_rows(
        self,
        job: ShadowJob,
        version: str,
        scores: np.ndarray,
        engine: str,
        latency_ms: float,
        thresholds: Thresholds,
        champion: Thresholds,
    ) -> None:
        if len(scores) != len(job.request_ids):
            raise ValueError(f"{len(scores)} scores for {len(job.request_ids)} rows")
        for row, score in enumerate(scores.tolist()):
            decision = thresholds.decide(score)
            if decision != champion.decide(float(job.champion_scores[row])):
                self.decision_flips += 1
            self._log.log(
                ExperimentRecord(
                    request_id=job.request_ids[row],
                    entity_id=job.entity_ids[row],
                    experiment=job.experiment,
                    model=job.model,
                    arm="challenger",
                    version=version,
                    score=score,
                    decision=decision,
                    engine=engine,
                    latency_ms=latency_ms,
                    mode=job.mode,
                    served=False,
                )
            )
