"""Deadline-aware, work-conserving micro-batching of one model version's requests.

Requests wait in an earliest-deadline-first heap. A worker that is free takes what is queued at
once (no added delay at light load); while the workers are busy the heap fills, so batches grow
with load. Each take stops before a request that would make the batch late for anyone in it,
using an online linear model of engine time against padded batch cells. A request that cannot
make its deadline even alone is failed at admission or at dispatch, never run.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np
from opentelemetry.trace import SpanContext
from opentelemetry.util.types import AttributeValue

from service.codec import RowBatch
from service.errors import DeadlineMissed, Overloaded, ScoringFailed, ServiceError, Unavailable
from service.telemetry import Telemetry, batch_span, current_span_context

__all__ = ["BatchOutcome", "EngineTimeModel", "MicroBatcher", "Scored"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What running one merged batch produced."""

    scores: np.ndarray  # (rows,)
    engine: str
    fallback_reason: str
    engine_s: float
    precision: str = ""
    # The engine of each row, where a batch was split between an engine and the fallback.
    row_engines: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Scored:
    """One caller's share of an executed batch."""

    scores: np.ndarray
    engine: str
    fallback_reason: str
    queue_s: float
    engine_s: float
    batch_rows: int
    degraded: bool = False
    # Monotonic nanoseconds: queued, handed to the engine, back from it (stage spans).
    enqueued_ns: int = 0
    dispatched_ns: int = 0
    done_ns: int = 0
    row_engines: tuple[str, ...] = ()

    def row_engine(self, row: int) -> tuple[str, str]:
        """The engine that scored `row` and why it was not the preferred one ('' if it was)."""
        if not self.row_engines:  # the whole batch ran on one engine
            return self.engine, self.fallback_reason
        # A split batch: rows on the preferred engine carry no fallback reason.
        engine = self.row_engines[row]
        return engine, (self.fallback_reason if engine != self.engine else "")


class EngineTimeModel:
    """Online fit of engine seconds = a + b * padded cells (rows x history length).

    Exponentially weighted least squares, so it follows the machine as load and clocks change.
    """

    def __init__(
        self, forget: float = 0.98, initial_s: float = 0.001, margin: float = 1.25
    ) -> None:
        self._forget = forget
        # Estimates are means; queueing behind them is not. 25 % headroom keeps the admitted
        # requests' tail inside the deadline instead of at it.
        self.margin = margin
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._initial_s = initial_s

    @staticmethod
    def cells(rows: int, history_length: int) -> float:
        return float(rows * max(history_length, 1))

    def observe(self, rows: int, history_length: int, seconds: float) -> None:
        x = self.cells(rows, history_length)
        f = self._forget
        self._sw = f * self._sw + 1.0
        self._sx = f * self._sx + x
        self._sy = f * self._sy + seconds
        self._sxx = f * self._sxx + x * x
        self._sxy = f * self._sxy + x * seconds

    def estimate_s(self, rows: int, history_length: int) -> float:
        """Expected engine seconds, padded by `margin` so admission errs on the safe side."""
        return self._fit_s(rows, history_length) * self.margin

    def _fit_s(self, rows: int, history_length: int) -> float:
        if self._sw == 0.0:
            return self._initial_s
        x = self.cells(rows, history_length)
        mean_x, mean_y = self._sx / self._sw, self._sy / self._sw
        var_x = self._sxx / self._sw - mean_x * mean_x
        if var_x <= 1e-12 * max(mean_x * mean_x, 1.0):
            return mean_y * (x / mean_x if mean_x > 0 else 1.0)
        slope = max((self._sxy / self._sw - mean_x * mean_y) / var_x, 0.0)
        intercept = max(mean_y - slope * mean_x, 0.0)
        return intercept + slope * x


@dataclass(order=True, slots=True)
class _Job:
    deadline: float
    seq: int
    batch: RowBatch = field(compare=False)
    enqueued: float = field(compare=False)
    future: asyncio.Future[Scored] = field(compare=False)
    span_context: SpanContext | None = field(compare=False, default=None)


RunBatch = Callable[[RowBatch], BatchOutcome]


def merge(batches: list[RowBatch]) -> RowBatch:
    """Concatenate rows, padding every history to the longest in the batch."""
    if len(batches) == 1:
        return batches[0]
    features = np.concatenate([b.features for b in batches])
    if batches[0].history is None:
        return RowBatch(features, None, None)
    length = max(b.history_length for b in batches)
    width = batches[0].history.shape[2]  # type: ignore[union-attr]
    rows = features.shape[0]
    history = np.zeros((rows, length, width), dtype=np.float32)
    mask = np.zeros((rows, length), dtype=np.float32)
    start = 0
    for b in batches:
        end = start + b.rows
        history[start:end, : b.history_length] = b.history
        mask[start:end, : b.history_length] = b.mask
        start = end
    return RowBatch(features, history, mask)


class MicroBatcher:
    """One queue and its workers for one (model, version, engine pool)."""

    def __init__(
        self,
        run_batch: RunBatch,
        executor: Executor,
        *,
        max_batch_rows: int,
        max_queue_rows: int,
        workers: int,
        max_queue_delay_s: float = 0.0,
        time_model: EngineTimeModel | None = None,
        degrade_on_deadline: bool = False,
        telemetry: Telemetry | None = None,
        labels: tuple[str, str] = ("", ""),
    ) -> None:
        self._run_batch = run_batch
        self._executor = executor
        self.max_batch_rows = max_batch_rows
        self.max_queue_rows = max_queue_rows
        self._workers_n = workers
        self._max_queue_delay_s = max_queue_delay_s
        self.time_model = time_model or EngineTimeModel()
        self._degrade = degrade_on_deadline
        self._telemetry = telemetry
        self._model, self._version = labels
        self._heap: list[_Job] = []
        self._queued_rows = 0
        self._seq = itertools.count()
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._busy = 0
        # Expected end (monotonic seconds) of each batch now running, by batch sequence number.
        self._running_until: dict[int, float] = {}
        self._closing = False

    def run_batch(self, rows: RowBatch) -> BatchOutcome:
        """Run rows on the engines directly, bypassing the queue (warm-up, tools)."""
        return self._run_batch(rows)

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._worker(), name=f"batcher-worker-{i}")
            for i in range(self._workers_n)
        ]

    async def close(self, drain_s: float = 5.0) -> None:
        """Stop admitting; let queued work finish within `drain_s`, then fail the rest."""
        self._closing = True
        deadline = time.monotonic() + drain_s
        while (self._heap or self._busy) and time.monotonic() < deadline:
            self._ready.set()
            await asyncio.sleep(0.005)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while self._heap:
            job = heapq.heappop(self._heap)
            self._fail(job, Unavailable("server is shutting down"))

    async def submit(self, batch: RowBatch, deadline: float) -> Scored:
        """Queue `batch` to be scored by monotonic time `deadline`; wait for its scores."""
        if self._closing:
            raise Unavailable("server is shutting down")
        if self._queued_rows + batch.rows > self.max_queue_rows and self._queued_rows > 0:
            self._shed("queue_full")
            raise Overloaded(
                f"queue holds {self._queued_rows} rows, limit {self.max_queue_rows}; retry later"
            )
        now = time.monotonic()
        future: asyncio.Future[Scored] = asyncio.get_running_loop().create_future()
        context = current_span_context() if self._telemetry is not None else None
        job = _Job(deadline, next(self._seq), batch, now, future, context)
        if now + self._estimate_wait_s(batch) > deadline:
            self._shed("deadline")
            if self._degrade:
                return self._degraded(job, now)
            raise DeadlineMissed("the request cannot be scored within its deadline at this load")
        heapq.heappush(self._heap, job)
        self._queued_rows += batch.rows
        self._ready.set()
        return await future

    def _estimate_wait_s(self, batch: RowBatch) -> float:
        """Time until `batch` would be done: a worker to free up, the queue ahead, its own run."""
        model = self.time_model
        length = batch.history_length
        own = model.estimate_s(batch.rows, length)
        if self._busy < self._workers_n and not self._heap:
            return own
        now = time.monotonic()
        # The soonest a worker frees: what the running batches were expected to take, less
        # what they have run (a batch past its estimate counts as about to finish).
        running = sorted(max(end - now, 0.0) for end in self._running_until.values())
        free_in = 0.0 if len(running) < self._workers_n else running[0]
        queued = self._queued_rows
        full_batches, rest = divmod(queued, self.max_batch_rows)
        ahead = full_batches * model.estimate_s(self.max_batch_rows, length)
        if rest:
            ahead += model.estimate_s(rest, length)
        return free_in + ahead / self._workers_n + own

    def _shed(self, reason: str) -> None:
        if self._telemetry is not None:
            self._telemetry.metrics.count_shed(self._model, reason)

    def _fail(self, job: _Job, exc: ServiceError) -> None:
        if not job.future.done():
            job.future.set_exception(exc)

    def _pop(self) -> _Job:
        job = heapq.heappop(self._heap)
        self._queued_rows -= job.batch.rows
        return job

    def _take(self) -> list[_Job]:
        """The jobs of the next batch, earliest deadline first, none of them made late."""
        now = time.monotonic()
        model = self.time_model
        taken: list[_Job] = []
        rows = 0
        length = 0
        earliest = float("inf")
        while self._heap:
            job = self._heap[0]
            if job.future.done():  # the caller went away (cancelled)
                self._pop()
                continue
            if now + model.estimate_s(job.batch.rows, job.batch.history_length) > job.deadline:
                self._pop()
                self._shed("deadline")
                if self._degrade:
                    job.future.set_result(self._degraded(job, now))
                else:
                    self._fail(job, DeadlineMissed("deadline passed while queued"))
                continue
            new_rows = rows + job.batch.rows
            new_length = max(length, job.batch.history_length)
            if taken and new_rows > self.max_batch_rows:
                break
            if taken and now + model.estimate_s(new_rows, new_length) > min(earliest, job.deadline):
                break
            taken.append(self._pop())
            rows, length = new_rows, new_length
            earliest = min(earliest, job.deadline)
        return taken

    @staticmethod
    def _degraded(job: _Job, now: float) -> Scored:
        scores = np.full(job.batch.rows, np.nan, dtype=np.float32)
        return Scored(scores, "", "deadline", now - job.enqueued, 0.0, 0, degraded=True)

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._heap:
                self._ready.clear()
                await self._ready.wait()
            if self._max_queue_delay_s > 0 and self._queued_rows < self.max_batch_rows:
                await asyncio.sleep(self._max_queue_delay_s)
            jobs = self._take()
            if not jobs:
                continue
            rows = sum(j.batch.rows for j in jobs)
            length = max(j.batch.history_length for j in jobs)
            token = next(self._seq)
            self._running_until[token] = time.monotonic() + self.time_model.estimate_s(rows, length)
            self._busy += 1
            try:
                await self._execute(loop, jobs)
            finally:
                self._busy -= 1
                del self._running_until[token]

    async def _execute(self, loop: asyncio.AbstractEventLoop, jobs: list[_Job]) -> None:
        merged_rows = sum(j.batch.rows for j in jobs)
        length = max(j.batch.history_length for j in jobs)
        started_ns = time.monotonic_ns()
        started = started_ns / 1e9
        try:
            outcome = await self._run_traced(loop, jobs, merged_rows, length)
        except ServiceError as exc:
            for job in jobs:
                self._fail(job, exc)
            return
        except Exception:
            log.exception("batch of %d rows failed", merged_rows)
            for job in jobs:
                self._fail(job, ScoringFailed("scoring failed"))
            return
        done_ns = time.monotonic_ns()
        self.time_model.observe(merged_rows, length, outcome.engine_s)
        self._observe(jobs, outcome, merged_rows, started)
        start = 0
        for job in jobs:
            end = start + job.batch.rows
            if not job.future.done():
                job.future.set_result(
                    Scored(
                        outcome.scores[start:end],
                        outcome.engine,
                        outcome.fallback_reason,
                        started - job.enqueued,
                        outcome.engine_s,
                        merged_rows,
                        enqueued_ns=int(job.enqueued * 1e9),
                        dispatched_ns=started_ns,
                        done_ns=done_ns,
                        row_engines=outcome.row_engines[start:end],
                    )
                )
            start = end

    async def _run_traced(
        self, loop: asyncio.AbstractEventLoop, jobs: list[_Job], rows: int, length: int
    ) -> BatchOutcome:
        batches = [j.batch for j in jobs]
        if self._telemetry is None:
            return await loop.run_in_executor(
                self._executor, _merge_and_run, self._run_batch, batches
            )
        contexts = [j.span_context for j in jobs if j.span_context is not None]
        attributes: dict[str, AttributeValue] = {
            "riskserve.model": self._model,
            "riskserve.version": self._version,
            "riskserve.batch.size": rows,
            "riskserve.batch.requests": len(jobs),
            "riskserve.batch.history_length": length,
        }
        with batch_span(self._telemetry.tracer, contexts, attributes) as span:
            outcome = await loop.run_in_executor(
                self._executor, _merge_and_run, self._run_batch, batches
            )
            span.set_attribute("riskserve.engine", outcome.engine)
            span.set_attribute("riskserve.precision", outcome.precision)
            span.set_attribute("riskserve.fallback_reason", outcome.fallback_reason)
        return outcome

    def _observe(self, jobs: list[_Job], outcome: BatchOutcome, rows: int, started: float) -> None:
        if self._telemetry is None:
            return
        metrics = self._telemetry.metrics
        metrics.observe_batch(self._model, self._version, outcome.engine, rows, outcome.engine_s)
        for job in jobs:
            metrics.observe_queue_wait(self._model, self._version, started - job.enqueued)
        if outcome.fallback_reason:
            # The reason's first word only, so the metric's label set stays small.
            metrics.count_fallback(self._model, outcome.fallback_reason.split(":", 1)[0])


def _merge_and_run(run_batch: RunBatch, batches: list[RowBatch]) -> BatchOutcome:
    return run_batch(merge(batches))
