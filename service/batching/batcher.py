"""Deadline-aware, work-conserving micro-batching of one model version's requests.

Requests wait in an earliest-deadline-first heap. A free engine worker takes what is queued at
once (no added delay at light load); while the workers are busy the heap fills, so batches grow
with load. Each take stops before a request that would make the batch late for anyone in it,
using an online linear model of engine time against padded batch cells. A request that cannot
make its deadline even alone is failed at admission or at dispatch, never run.

A batch the engine-time model expects to take at most `inline_max_s` (3 ms by default: ONNX
Runtime on CPU at small batches) runs on the event loop itself, when no other batch is running:
a submit schedules one dispatch callback (`call_soon`), so the requests that became ready in the
same turn of the loop join the batch, and the engine runs inline. ONNX Runtime releases the GIL
while it runs and gRPC's core keeps reading the wire on its own threads, so little is lost by
blocking the loop that briefly; what is gained is that no request waits for a thread to get the
GIL back. A hand-off to an engine thread and back takes the GIL twice, each time up to the
interpreter's switch interval (5 ms) while the loop is busy: that, not compute, was most of the
latency of a lightly loaded server.

That holds while calls come one at a time. Where they overlap, a batch run on the loop holds
one request: grpc.aio hands the loop one new call at a time, several turns apart, and none
while the loop computes. So short batches go to an engine thread while calls overlap, and the
loop accepts the calls that arrive meanwhile: they make the next batch. Whether calls overlap
is learnt from the runs on a thread (`_Offload`): a run counts for it when its batch held more
than one request or more than one request was submitted while it ran (an exponential average
over about eight runs; short batches go to a thread while a quarter or more count). While they
run on the loop, one in sixteen goes to a thread anyway, to find out. One caller pays a thread
hop on one batch in sixteen; 16 closed-loop callers get batches of about 3.6 requests, and the
best rate within a 10 ms p99 was 1.3 times batching off's (docs/benchmarks.md, "Unary
micro-batching"). A lone extra arrival does not count: two callers alternate batches of one,
and a thread hop each would only cost them. Where a batch holds one row (`max_batch_rows` 1)
nothing can join it, and short batches stay on the loop.

The loader turns this off (`inline_max_s=0`) for a pool holding any engine whose call can hang
(`Engine.can_hang`: a GPU engine, or one under the watchdog), since a hung call on the loop would
stop the whole server. Longer batches (long histories, big batches, slow engines) go to the
engine threads, so the loop keeps admitting, queueing and shedding while they run. Each worker
is a thread of its own that runs one merged batch at a time. Dispatch happens on the event
loop, in the call that queued a request or in the callback that reports a finished batch: no
task wakes up to look at the queue, and a batch crosses threads once each way.

Where `gather_s` is set (`RISKSERVE_GATHER_US`; off by default), a batch the loop would start
with a single unary request first waits that long for company, on a timer: the loop blocks in
its selector meanwhile, so gRPC's poller thread hands it every call that arrives, and each joins
the queue. It was measured before short batches went to a thread while calls overlap: without
the wait, 97 % of batches at 16 closed-loop callers then held one row, and each paid the
engine's fixed cost and the per-batch work alone.
Waiting by spinning the loop instead (a turn at a time) batched as well on an idle machine, but
on one short of CPU the spinning thread starved the poller thread and throughput halved. A wait
ends early once as many requests are queued as the last one gathered: closed-loop callers send
nothing more until answered, and the selector would wake the loop only to the millisecond. No
batch waits where recent waits brought no company (light load: one probe in 256 batches then),
where the earliest deadline has no room for it, or for stream messages (`ARRIVES_ALONE`), which
many streams deliver in the same turn. It is off by default because open-loop traffic loses by
it: with 1 ms waits `make loadtest`'s mix at 800 requests a second shed 16 requests where none
were shed without, and the server's own p99 rose from within 3 ms to within 8
(docs/benchmarks.md), though 16 and 64 closed-loop callers got 9 % more answers for 11 to 13 %
less CPU.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from service.batching.rows import MAX_PADDING, RowBatch
from service.errors import DeadlineMissed, Overloaded, ScoringFailed, ServiceError, Unavailable
from service.prctl import PR_SET_NAME, prctl
from service.telemetry import BatchTrace, RequestTrace, Telemetry, current_request_trace

__all__ = [
    "ARRIVES_ALONE",
    "GATHER_S",
    "INLINE_MAX_S",
    "EngineTimeModel",
    "MicroBatcher",
    "Scored",
]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Scored:
    """Scores and how they were made: what an engine run returns for its whole batch, and
    what each caller gets back for its share (the batcher slices the one into the others)."""

    scores: np.ndarray  # (rows,)
    engine: str
    fallback_reason: str = ""
    engine_s: float = 0.0
    precision: str = ""
    # The engine of each row, where a batch was split between an engine and the fallback.
    row_engines: tuple[str, ...] = ()
    batch_rows: int = 0
    queue_s: float = 0.0
    degraded: bool = False
    # Monotonic nanoseconds: queued, handed to the engine, back from it (stage spans).
    enqueued_ns: int = 0
    dispatched_ns: int = 0
    done_ns: int = 0
    # The executed batch's trace (None when tracing is off or nothing ran).
    batch_trace: BatchTrace | None = None

    @classmethod
    def joined(cls, runs: Sequence[Scored]) -> Scored:
        """Engine runs of consecutive rows as one: scores in order, engine time summed; each
        row's engine where they differ. The engine and precision are those of the first run
        that did not fall back whole, so that `row_engine` gives the fallback reason to the
        rows that fell back, whichever run they were in."""
        preferred = next(
            (run for run in runs if run.row_engines or not run.fallback_reason), runs[0]
        )
        per_row = [
            engine
            for run in runs
            for engine in (run.row_engines or (run.engine,) * len(run.scores))
        ]
        return cls(
            np.concatenate([run.scores for run in runs]),
            preferred.engine,
            next((run.fallback_reason for run in runs if run.fallback_reason), ""),
            sum(run.engine_s for run in runs),
            preferred.precision,
            tuple(per_row) if len(set(per_row)) > 1 else (),
            batch_rows=sum(run.batch_rows for run in runs),
        )

    def finite(self, start: int = 0, end: int | None = None) -> bool:
        """Whether every row in `start:end` has a score to answer with: a finite one, or none
        by design (a degraded answer carries the fallback decision)."""
        return self.degraded or bool(np.isfinite(self.scores[start:end]).all())

    def require_finite(self, start: int = 0, end: int | None = None) -> None:
        """Raise ScoringFailed where a row in `start:end` has no finite score (`finite`): the
        last engine tried (the fallback) gave none, and a decision made from it would be no
        decision."""
        if not self.finite(start, end):
            raise ScoringFailed("the model gave no finite score for this request's rows")

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

    def __init__(self, forget: float = 0.98, initial_s: float = 0.001) -> None:
        self._forget = forget
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._initial_s = initial_s

    @staticmethod
    def cells(rows: int, history_length: int) -> float:
        """The padded cells of `rows` rows each with a history of `history_length`."""
        return float(rows * max(history_length, 1))

    def observe(self, x: float, seconds: float) -> None:
        """One run of `seconds` for a batch of `x` cells. A run far longer than the fit expects
        (a call the watchdog gave up on after a second, a stall) counts as `OUTLIER_FACTOR`
        times the estimate: taken whole, one such run raised every estimate past the default
        budget, and a batcher that refuses every request runs no batch to learn it was wrong."""
        if self._sw > 0.0:
            seconds = min(seconds, OUTLIER_FACTOR * max(self.estimate_s(x), 1e-6))
        f = self._forget
        self._sw = f * self._sw + 1.0
        self._sx = f * self._sx + x
        self._sy = f * self._sy + seconds
        self._sxx = f * self._sxx + x * x
        self._sxy = f * self._sxy + x * seconds

    def estimate_s(self, x: float) -> float:
        """Expected engine seconds for a batch of `x` cells (`cells`, or `RowBatch.cells` for
        rows against one history; a mean: `service.batching.budget.MARGIN` covers its error)."""
        if self._sw == 0.0:
            return self._initial_s
        mean_x, mean_y = self._sx / self._sw, self._sy / self._sw
        var_x = self._sxx / self._sw - mean_x * mean_x
        if var_x <= 1e-12 * max(mean_x * mean_x, 1.0):
            return mean_y * (x / mean_x if mean_x > 0 else 1.0)
        slope = max((self._sxy / self._sw - mean_x * mean_y) / var_x, 0.0)
        intercept = mean_y - slope * mean_x
        if intercept < 0.0:
            # No negative fixed cost: the line through the mean run from the origin. Clamping
            # the intercept alone kept a slope that one odd run among runs of one size set
            # (500 runs of 1 ms at 16 cells and one of 3 ms at 17 gave 32 ms at 16).
            return mean_y * x / mean_x
        return intercept + slope * x


# The most, as a multiple of its estimate, that one engine run counts for in the time model.
OUTLIER_FACTOR = 10.0
# Up to this many queued jobs, admission counts only those due before a new request as ahead.
_EXACT_AHEAD_JOBS = 64


@dataclass(order=True, slots=True)
class _Job:
    deadline: float
    seq: int
    parts: tuple[RowBatch, ...] = field(compare=False)
    rows: int = field(compare=False)
    history_length: int = field(compare=False)
    enqueued: float = field(compare=False)
    future: asyncio.Future[Scored] = field(compare=False)
    trace: RequestTrace | None = field(compare=False, default=None)
    # Rows against one history (`RowBatch.shares_history`): run alone, costed by their cells.
    shared: bool = field(compare=False, default=False)
    # Whether a batch it starts alone waits for company (`ARRIVES_ALONE`).
    gathers: bool = field(compare=False, default=True)
    # The requests its rows answer (stream messages queued as one job).
    requests: int = field(compare=False, default=1)
    # Whether its rows count in the queue's rows: from its push until its pop, or until its
    # caller goes away (cancelled), which leaves it in the heap for a take to pass by.
    counted: bool = field(compare=False, default=False)
    # Its padded cells, what the time model costs it by: worked out once, as admission, the
    # queue's counts and every take read them.
    cells: float = field(compare=False, init=False, default=0.0)

    def __post_init__(self) -> None:
        if self.shared:
            self.cells = float(sum(p.cells for p in self.parts))
        else:
            self.cells = EngineTimeModel.cells(self.rows, self.history_length)


@dataclass(slots=True)
class _Running:
    """A batch handed to an engine thread, as the event loop keeps track of it."""

    jobs: list[_Job]
    rows: int
    history_length: int
    cells: float
    started_ns: int
    expected_end: float  # monotonic seconds, from the engine-time model
    trace: BatchTrace | None
    # Requests submitted before it went to an engine thread (-1: it runs on the event loop).
    submitted: int = -1


RunBatch = Callable[[RowBatch], Scored]


def _name_os_thread(name: str) -> None:
    """Give the calling thread `name` (its first 15 bytes) where the OS shows thread names, so
    `top -H`, /proc and profilers tell an engine thread from gRPC's (Linux only)."""
    prctl(PR_SET_NAME, name.encode()[:15])


def _parts(jobs: list[_Job]) -> list[RowBatch]:
    return [part for job in jobs for part in job.parts]


# Jobs passed over for padding in one take, so a long queue is never scanned whole.
_MAX_DEFERRED = 16
# Batches expected to run at most this long run on the event loop (see the module's notes). The
# estimate follows a loaded machine's slower runs, so the bound sits well above a small batch's
# 0.15 to 1 ms, below a slow engine's 5 ms and more.
INLINE_MAX_S = 0.003
# Short batches go to an engine thread while at least this share of recent runs on a thread had
# company (an exponential average, each run weighing `_OFFLOAD_WEIGHT`; see the module's notes).
_OFFLOAD_WORTH = 0.25
_OFFLOAD_WEIGHT = 0.125
# While short batches run on the event loop, one in this many goes to a thread anyway, to see
# whether company would come.
_OFFLOAD_PROBE_EVERY = 16
# How long a batch started alone waits for company (see the module's notes); off by default.
GATHER_S = 0.0
# Batches wait for company while `_Gather.worth` stays above this: after a wait that brought
# company, until two in a row brought none.
_GATHER_WORTH = 0.2
# Where waits stopped bringing company, one batch in this many waits anyway, so that a load
# that rises is noticed.
_GATHER_PROBE_EVERY = 256

# Whether requests submitted in this context reach the batcher one at a time, so that a batch
# started alone with one is worth a wait for company: true of unary calls, which grpc.aio
# hands the event loop one at a time; a stream sets it false for its messages, which arrive as
# their reads complete, many a turn.
ARRIVES_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "riskserve_arrives_alone", default=True
)


class _Offload:
    """Whether the next short batch runs on an engine thread, so that the event loop accepts
    calls while it runs, and how often recent runs on a thread had company."""

    __slots__ = ("since_probe", "worth")

    def __init__(self) -> None:
        self.worth = 0.0  # the share of recent runs on a thread that had company
        self.since_probe = 0  # short batches run on the loop since the last one on a thread

    def wanted(self) -> bool:
        if self.worth >= _OFFLOAD_WORTH:
            return True
        self.since_probe += 1
        if self.since_probe < _OFFLOAD_PROBE_EVERY:
            return False
        self.since_probe = 0
        return True

    def ran(self, company: bool) -> None:
        """A batch ran on a thread; `company`: whether it held more than one request or more
        than one was submitted while it ran."""
        self.worth += (company - self.worth) * _OFFLOAD_WEIGHT


class _Gather:
    """The wait for company of the next batch the event loop runs, and how recent ones went."""

    __slots__ = ("early", "expected", "rows", "since_probe", "started", "started_at", "worth")

    def __init__(self) -> None:
        self.started = False  # whether a batch is waiting now
        self.started_at = 0.0  # monotonic seconds
        self.early = False  # whether the wait is cut short (its company came, or closing)
        self.rows = 0  # rows queued when the wait began
        # Recent waits that brought company, each counting half as much as the next one.
        self.worth = 0.0
        self.since_probe = 0  # batches started without a wait since the last one
        # The rows the last wait gathered: a wait ends as soon as that many are queued, since
        # closed-loop callers send no more until answered (0: it waits its whole time).
        self.expected = 0

    def start(self, rows: int, now: float) -> None:
        self.started, self.started_at, self.rows, self.since_probe = True, now, rows, 0
        self.early = False

    def end(self, rows: int, window_s: float) -> None:
        """The wait is over with `rows` queued: its time passed, or it was cut short."""
        found = rows > self.rows
        self.worth = (self.worth + found) / 2
        if not self.early:
            self.expected = rows if found else 0
        elif time.monotonic() - self.started_at < window_s / 4:
            self.expected = max(self.expected, rows) + 1  # it came fast: there may be more
        self.started = False

    def ends_early(self, rows: int) -> bool:
        return self.started and 0 < self.expected <= rows


class MicroBatcher:
    """One queue and its engine threads for one (model, version, engine pool)."""

    def __init__(
        self,
        run_batch: RunBatch,
        *,
        max_batch_rows: int,
        max_queue_rows: int,
        workers: int,
        max_queue_delay_s: float = 0.0,
        time_model: EngineTimeModel | None = None,
        degrade_on_deadline: bool = False,
        telemetry: Telemetry | None = None,
        labels: tuple[str, str] = ("", ""),
        inline_max_s: float = INLINE_MAX_S,
        gather_s: float = GATHER_S,
    ) -> None:
        """`inline_max_s`: batches expected to be at most this fast run on the event loop (0:
        every batch goes to an engine thread). `gather_s`: how long such a batch, started with
        one unary request, waits for company where recent waits found some (0: never)."""
        self._run_batch = run_batch
        self._inline_max_s = inline_max_s
        self._gather_s = gather_s
        self._gather = _Gather()
        # Where a batch holds one row, nothing can join it: short batches stay on the loop.
        self._offload = _Offload() if max_batch_rows > 1 else None
        self._submitted = 0  # requests queued so far
        self.max_batch_rows = max_batch_rows
        self.max_queue_rows = max_queue_rows
        self._workers_n = workers
        self._max_queue_delay_s = max_queue_delay_s
        self.time_model = time_model or EngineTimeModel()
        self._degrade = degrade_on_deadline
        self._telemetry = telemetry
        self._tracing = telemetry.tracing if telemetry is not None else None
        self._model, self._version = labels
        self._heap: list[_Job] = []
        self._queued_rows = 0
        self._queued_cells = 0.0  # their padded cells, each job at its own history length
        self._seq = itertools.count()
        self._running: dict[int, _Running] = {}
        self._inbox: queue.SimpleQueue[tuple[int, list[RowBatch]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._delayed: asyncio.TimerHandle | None = None
        self._scheduled: asyncio.Handle | None = None
        self._closing = False

    def run_batch(self, rows: RowBatch) -> Scored:
        """Run rows on the engines directly, bypassing the queue (warm-up, tools)."""
        return self._run_batch(rows)

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def start(self) -> None:
        """Start the engine threads; call from inside the running event loop."""
        self._loop = asyncio.get_running_loop()
        name = f"engine-{self._model}-{self._version}"
        # Daemon threads: an engine call that never returns must not keep the process alive.
        self._threads = [
            threading.Thread(target=self._engine_thread, name=f"{name}-{i}", daemon=True)
            for i in range(self._workers_n)
        ]
        for thread in self._threads:
            thread.start()

    async def close(self, drain_s: float = 5.0) -> None:
        """Stop admitting; let queued work finish within `drain_s`, then fail the rest."""
        self._closing = True
        self._kick()
        deadline = time.monotonic() + drain_s
        while (self._heap or self._running) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        for _ in self._threads:
            self._inbox.put(None)
        while self._heap:
            self._fail(self._pop(), Unavailable("server is shutting down"))
        for running in self._running.values():
            for job in running.jobs:
                self._fail(job, Unavailable("server is shutting down"))

    async def submit(
        self, batch: RowBatch | Sequence[RowBatch], deadline: float, requests: int = 1
    ) -> Scored:
        """Queue a request's rows to be scored by monotonic time `deadline`; wait for their
        scores. Rows given as several parts are padded together only with their batch.
        `requests`: how many requests the rows answer (stream messages queued together)."""
        parts = (batch,) if isinstance(batch, RowBatch) else tuple(batch)
        rows = sum(p.rows for p in parts)
        length = max(p.history_length for p in parts)
        if self._closing:
            raise Unavailable("server is shutting down")
        if self._queued_rows + rows > self.max_queue_rows and self._queued_rows > 0:
            self._shed("queue_full", requests)
            raise Overloaded(
                f"queue holds {self._queued_rows} rows, limit {self.max_queue_rows}; retry later"
            )
        assert self._loop is not None, "start() the batcher first"
        now = time.monotonic()
        future: asyncio.Future[Scored] = self._loop.create_future()
        trace = current_request_trace() if self._tracing is not None else None
        shared = any(p.shares_history for p in parts)
        job = _Job(
            deadline,
            next(self._seq),
            parts,
            rows,
            length,
            now,
            future,
            trace,
            shared,
            ARRIVES_ALONE.get(),
            requests,
        )
        if now + self._estimate_wait_s(job.cells, deadline) > deadline:
            self._shed("deadline", requests)
            if self._degrade:
                return self._degraded(job, now)
            raise DeadlineMissed("the request cannot be scored within its deadline at this load")
        heapq.heappush(self._heap, job)
        self._count(job)
        self._submitted += requests
        self._kick()
        try:
            return await future
        except asyncio.CancelledError:
            # The caller went away (its deadline, a hang-up): its rows no longer fill the
            # queue, which would refuse others as full while nothing live waits in it.
            self._uncount(job)
            raise

    def _estimate_wait_s(self, cells: float, deadline: float) -> float:
        """Time until a job of `cells` due by `deadline` would be done: a worker to free up,
        the queue ahead of it, its own run."""
        model = self.time_model
        own = model.estimate_s(cells)
        if len(self._running) < self._workers_n and not self._heap:
            return own
        now = time.monotonic()
        # The soonest a worker frees: what the running batches were expected to take, less
        # what they have run (a batch past its estimate counts as about to finish).
        running = sorted(max(r.expected_end - now, 0.0) for r in self._running.values())
        free_in = 0.0 if len(running) < self._workers_n else running[0]
        # The queue in batches of the most rows, each job at its own history length (priced at
        # this one's, 60 one-row jobs of 1 cell were 1.2 s of work ahead of a 200-row history).
        # The fit is a line, so those batches take what that many batches of their mean take.
        rows, queued_cells = self._ahead(deadline)
        ahead = 0.0
        if rows:
            batches = -(-rows // self.max_batch_rows)
            ahead = batches * model.estimate_s(max(queued_cells, 0.0) / batches)
        return free_in + ahead / self._workers_n + own

    def _ahead(self, deadline: float) -> tuple[int, float]:
        """The queued rows and cells a job due by `deadline` would wait for: in a short queue,
        those due no later (the queue is taken earliest deadline first); in a long one, all
        of it, rather than a pass over every job for each request."""
        if len(self._heap) > _EXACT_AHEAD_JOBS:
            return self._queued_rows, self._queued_cells
        rows, cells = 0, 0.0
        for job in self._heap:
            if job.counted and job.deadline <= deadline:
                rows += job.rows
                cells += job.cells
        return rows, cells

    def _shed(self, reason: str, requests: int) -> None:
        if self._telemetry is not None:
            self._telemetry.metrics.count_shed(self._model, reason, requests)

    def _fail(self, job: _Job, exc: ServiceError) -> None:
        if not job.future.done():
            job.future.set_exception(exc)

    def _pop(self) -> _Job:
        job = heapq.heappop(self._heap)
        self._uncount(job)
        return job

    def _count(self, job: _Job) -> None:
        job.counted = True
        self._queued_rows += job.rows
        self._queued_cells += job.cells

    def _uncount(self, job: _Job) -> None:
        if job.counted:
            job.counted = False
            self._queued_rows -= job.rows
            self._queued_cells -= job.cells

    def _take(self) -> list[_Job]:
        """The jobs of the next batch, earliest deadline first, none of them made late.

        A job whose history length would make padding more than a third of the batch's cells
        waits for the next batch instead (at most `_MAX_DEFERRED` are passed over a take);
        it is then the earliest deadline left, so it goes first. A job of rows against one
        history runs alone: merged, its history would be computed once per row.
        """
        now = time.monotonic()
        model = self.time_model
        taken: list[_Job] = []
        deferred: list[_Job] = []
        rows = 0
        length = 0
        cells = 0  # the rows' own history cells, without padding
        earliest = float("inf")
        while self._heap:
            job = self._heap[0]
            if job.future.done():  # the caller went away (cancelled)
                self._pop()
                continue
            job_rows, job_length = job.rows, job.history_length
            if now + model.estimate_s(job.cells) > job.deadline:
                self._pop()
                self._shed("deadline", job.requests)
                if self._degrade:
                    job.future.set_result(self._degraded(job, now))
                else:
                    self._fail(job, DeadlineMissed("deadline passed while queued"))
                continue
            if job.shared and taken:
                break
            new_rows = rows + job_rows
            new_length = max(length, job_length)
            new_cells = cells + job_rows * max(job_length, 1)
            if taken and new_rows > self.max_batch_rows:
                break
            if taken and new_rows * max(new_length, 1) > MAX_PADDING * new_cells:
                if len(deferred) >= _MAX_DEFERRED:
                    break
                deferred.append(self._pop())
                continue
            if taken and now + model.estimate_s(model.cells(new_rows, new_length)) > min(
                earliest, job.deadline
            ):
                break
            taken.append(self._pop())
            rows, length, cells = new_rows, new_length, new_cells
            earliest = min(earliest, job.deadline)
            if job.shared:
                break
        for job in deferred:
            heapq.heappush(self._heap, job)
            self._count(job)
        return taken

    @staticmethod
    def _degraded(job: _Job, now: float) -> Scored:
        scores = np.full(job.rows, np.nan, dtype=np.float32)
        return Scored(scores, "", "deadline", queue_s=now - job.enqueued, degraded=True)

    # -- dispatch (event loop) -------------------------------------------------------------

    def _kick(self) -> None:
        """Hand queued work to free workers now, or after the configured extra wait where the
        earliest deadline has room for all of it and then the queue's batch run (a request
        come during the wait with less room ends it)."""
        if not self._heap or len(self._running) >= self._workers_n:
            return
        delay_s = self._max_queue_delay_s
        if delay_s > 0 and not self._closing and self._queued_rows < self.max_batch_rows:
            loop = self._loop
            assert loop is not None
            if self._delayed is not None:
                if self._room_s() > self._delayed.when() - loop.time():
                    return
            elif delay_s < self._room_s():
                self._delayed = loop.call_later(delay_s, self._after_delay)
                return
        if self._delayed is not None:
            self._delayed.cancel()
            self._delayed = None
        self._dispatch()

    def _waits_past_room(self) -> bool:
        """Whether the wait for company now running ends later than the queue has room for."""
        waiting, loop = self._scheduled, self._loop
        if not isinstance(waiting, asyncio.TimerHandle) or loop is None:
            return False
        return self._room_s() <= waiting.when() - loop.time()

    def _room_s(self) -> float:
        """How long the queued rows could wait and still, run as one batch, meet the earliest
        deadline among them (the head of the queue)."""
        head = self._heap[0]
        model = self.time_model
        run_s = model.estimate_s(model.cells(self._queued_rows, head.history_length))
        return head.deadline - time.monotonic() - run_s

    def _after_delay(self) -> None:
        self._delayed = None
        self._dispatch()

    def _dispatch(self) -> None:
        while self._heap and len(self._running) < self._workers_n:
            if self._inline_max_s > 0 and not self._running:
                assert self._loop is not None
                if self._scheduled is None:
                    # Decided later in this turn of the loop, so the requests ready now join in.
                    self._scheduled = self._loop.call_soon(self._dispatch_next)
                elif self._gather.started and (
                    self._queued_rows >= self.max_batch_rows
                    or self._closing
                    or self._gather.ends_early(self._queued_rows)
                    or self._waits_past_room()
                ):
                    # A full batch waits for no more company, nor one the server is closing,
                    # nor one whose expected company came, nor one that a request come since
                    # has no time left to wait for.
                    self._gather.early = True
                    self._scheduled.cancel()
                    self._scheduled = self._loop.call_soon(self._dispatch_next)
                return
            self._hand_off()

    def _hand_off(self) -> None:
        token, running = self._start_next()
        if running is not None:
            self._to_thread(token, running)

    def _to_thread(self, token: int, running: _Running) -> None:
        """Queue a started batch for an engine thread, noting the requests submitted so far
        (`_finish` learns from them whether calls overlap)."""
        running.submitted = self._submitted
        self._inbox.put((token, _parts(running.jobs)))

    def _dispatch_next(self) -> None:
        """Start the next batch: on the event loop when it is short, else on an engine thread."""
        self._scheduled = None
        if self._running:  # a batch went to a thread meanwhile; its end dispatches again
            return
        wait_s = self._gather_wait_s()
        if wait_s > 0:
            assert self._loop is not None
            self._scheduled = self._loop.call_later(wait_s, self._dispatch_next)
            return
        while self._heap:
            token, running = self._start_next()
            if running is None:
                continue
            estimate_s = self.time_model.estimate_s(running.cells)
            offload = self._offload
            if estimate_s > self._inline_max_s or (offload is not None and offload.wanted()):
                self._to_thread(token, running)
                self._dispatch()  # more workers may be free
                return
            try:
                outcome: Scored | BaseException = self._run_parts(_parts(running.jobs))
            except Exception as exc:  # the batch fails, the loop goes on
                outcome = exc
            self._finish(token, outcome, time.monotonic_ns())
            return

    def _gather_wait_s(self) -> float:
        """How long the next batch waits for company first (0: none; see the module's notes).

        Called when the batch would start: a wait begins here, and its timer calls back here.
        """
        gather = self._gather
        if gather.started:  # the wait is over: its time has passed, or its company came
            gather.end(self._queued_rows, self._gather_s)
            return 0.0
        heap = self._heap
        # Company is already there, or none would come one at a time.
        if self._gather_s <= 0 or self._closing or len(heap) != 1 or not heap[0].gathers:
            return 0.0
        gather.since_probe += 1
        if gather.worth <= _GATHER_WORTH and gather.since_probe < _GATHER_PROBE_EVERY:
            return 0.0
        head = heap[0]
        now = time.monotonic()
        # The earliest deadline keeps room for the wait and then its batch's run.
        room_s = head.deadline - now - self._gather_s
        model = self.time_model
        if room_s <= model.estimate_s(model.cells(self._queued_rows, head.history_length)):
            return 0.0
        gather.start(self._queued_rows, now)
        return self._gather_s

    def _run_parts(self, parts: Sequence[RowBatch]) -> Scored:
        """One engine run of the parts joined; a job of rows against one history (run alone)
        has each part run as it is, one after another, and their scores joined in order."""
        if len(parts) == 1 or not any(p.shares_history for p in parts):
            return self._run_batch(RowBatch.concat(parts))
        return Scored.joined([self._run_batch(part) for part in parts])

    def _start_next(self) -> tuple[int, _Running | None]:
        """Take the next batch off the heap and record it as running (None: nothing to take)."""
        jobs = self._take()
        token = next(self._seq)
        if not jobs:
            return token, None
        rows = sum(j.rows for j in jobs)
        length = max(j.history_length for j in jobs)
        cells = jobs[0].cells if jobs[0].shared else EngineTimeModel.cells(rows, length)
        trace = None
        if self._tracing is not None:
            trace = self._tracing.start_batch(
                [j.trace for j in jobs],
                {
                    "riskserve.model": self._model,
                    "riskserve.version": self._version,
                    "riskserve.batch.size": rows,
                    "riskserve.batch.requests": len(jobs),
                    "riskserve.batch.history_length": length,
                },
            )
        running = _Running(
            jobs,
            rows,
            length,
            cells,
            time.monotonic_ns(),
            time.monotonic() + self.time_model.estimate_s(cells),
            trace,
        )
        self._running[token] = running
        return token, running

    def _engine_thread(self) -> None:
        _name_os_thread(threading.current_thread().name)
        loop = self._loop
        assert loop is not None
        while True:
            item = self._inbox.get()
            if item is None:
                return
            token, batches = item
            try:
                outcome: Scored | BaseException = self._run_parts(batches)
            except BaseException as exc:  # handed to the event loop, which fails the batch
                outcome = exc
            try:
                loop.call_soon_threadsafe(self._finish, token, outcome, time.monotonic_ns())
            except RuntimeError:  # the loop closed while the batch ran
                return

    def _finish(self, token: int, outcome: Scored | BaseException, done_ns: int) -> None:
        running = self._running.pop(token)
        if running.submitted >= 0 and self._offload is not None:  # it ran on a thread
            jobs, arrived = running.jobs, self._submitted - running.submitted
            self._offload.ran(len(jobs) > 1 or jobs[0].requests > 1 or arrived > 1)
        try:
            self._deliver(running, outcome, done_ns)
        finally:
            self._kick()

    def _deliver(self, running: _Running, outcome: Scored | BaseException, done_ns: int) -> None:
        jobs = running.jobs
        if isinstance(outcome, ServiceError):
            for job in jobs:
                self._fail(job, outcome)
            return
        if isinstance(outcome, BaseException):
            log.error("batch of %d rows failed", running.rows, exc_info=outcome)
            for job in jobs:
                self._fail(job, ScoringFailed("scoring failed"))
            return
        self.time_model.observe(running.cells, outcome.engine_s)
        started_ns = running.started_ns
        started = started_ns / 1e9
        if running.trace is not None:
            running.trace.end(
                {
                    "riskserve.engine": outcome.engine,
                    "riskserve.precision": outcome.precision,
                    "riskserve.fallback_reason": outcome.fallback_reason,
                }
            )
        self._observe(jobs, outcome, running.rows, started)
        start = 0
        for job in jobs:
            end = start + job.rows
            if not job.future.done():
                job.future.set_result(
                    Scored(
                        outcome.scores[start:end],
                        outcome.engine,
                        outcome.fallback_reason,
                        outcome.engine_s,
                        outcome.precision,
                        outcome.row_engines[start:end],
                        running.rows,
                        started - job.enqueued,
                        enqueued_ns=int(job.enqueued * 1e9),
                        dispatched_ns=started_ns,
                        done_ns=done_ns,
                        batch_trace=running.trace,
                    )
                )
            start = end

    def _observe(self, jobs: list[_Job], outcome: Scored, rows: int, started: float) -> None:
        if self._telemetry is None:
            return
        metrics = self._telemetry.metrics
        metrics.observe_batch(self._model, self._version, outcome.engine, rows, outcome.engine_s)
        metrics.observe_queue_waits(
            self._model, self._version, [started - job.enqueued for job in jobs]
        )
        if outcome.fallback_reason:
            # The reason's first word only, so the metric's label set stays small.
            metrics.count_fallback(self._model, outcome.fallback_reason.split(":", 1)[0])
