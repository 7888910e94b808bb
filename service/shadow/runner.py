"""`ShadowRunner`: hand shadow jobs to a separate, lowest-priority worker process.

The server's only work per job is `submit`: encode the validated arrays (about 2 µs) and a
non-blocking write to a socket pair. When `max_queued_jobs` jobs are in flight (written and not
yet acknowledged, wherever they are: the socket, the worker's pass, its engine), the next job
is dropped and counted: a comparison and two integer increments. The worker
(`service.shadow.worker`) scores, logs the challenger records as its own replica under the
same log prefix, and acknowledges with counts, which the event loop reads without blocking.

When the worker falls behind (half the bound in flight), or the machine has no CPU to spare for
it (its thread waited to run more than `CONTENDED_WAIT` of the time it ran, over a second: at
idle priority it runs only on CPU the server and others leave, and what it takes from a full
machine still shows in the champion's tail), the share of entities shadowed halves, down to
`min_sampled_share`, and doubles again once it has kept up for a while: what it scores is then a
deterministic sample, every entity whose hash falls below the share (`sampled`), rather than
whatever happened not to be dropped, so entity-level statistics stay unbiased. The share is a
gauge, each change a log line, and the report shows the coverage it gave.

If the worker dies, its jobs in flight are counted as dropped and a new one is started after a
back-off; the champion never waits on any of this. Drops are counted by reason and logged at
most once per `DROP_LOG_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from service.shadow.channel import FrameDecoder, encode_job, frame
from service.shadow.experiment import stable_unit_interval
from service.shadow.job import ShadowJob
from service.shadow.priority import lower_priority, restrict_cpus

__all__ = ["MIN_SAMPLED_SHARE", "ShadowRunner", "sampled"]

# The least share of entities shadowed when the worker cannot keep up, by default
# (RISKSERVE_SHADOW_MIN_SAMPLED_SHARE).
MIN_SAMPLED_SHARE = 1 / 64
# The share halves at most this often while the worker stays behind...
SHARE_DOWN_S = 1.0
# ...and doubles after the worker has kept up (a quarter of the bound or less in flight) this
# long at the current share: slowly, so a share the worker can just hold is held.
SHARE_UP_S = 10.0
# The worker's CPU is contended when its thread waited to run more than this share of the time
# it ran (over at least CONTENTION_WINDOW_S and 10 ms of both), and free again below the lower
# one: measured on two vCPUs under the load test's mix, 0.19 at its default load, where the
# champion's p99 holds, and 0.57 at twice it, where it does not.
CONTENDED_WAIT = 0.4
UNCONTENDED_WAIT = 0.25
CONTENTION_WINDOW_S = 1.0
_MIN_WINDOW_NS = 10_000_000
DROP_LOG_INTERVAL_S = 10.0

_log = logging.getLogger(__name__)

VersionDir = Callable[[str, str], Path]
"""``version_dir(model, version)`` -> the model version's folder; raises if it is not loaded."""


class _WorkerProtocol(asyncio.Protocol):
    def __init__(self, on_message: Callable[[tuple[Any, ...]], None]) -> None:
        self._on_message = on_message
        self._decoder = FrameDecoder()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._decoder.feed(data)
        for message in self._decoder.messages():
            self._on_message(message)

    def eof_received(self) -> bool:
        return False  # close the transport: the worker has finished

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)


class ShadowRunner:
    """One worker process, bounded jobs in flight, plain-int counters read by metrics."""

    def __init__(
        self,
        version_dir: VersionDir,
        log_prefix: str,
        *,
        replica_id: str,
        flush_interval_s: float = 1.0,
        log_rolling: Mapping[str, float] | None = None,
        max_queued_jobs: int = 1024,
        pass_interval_s: float = 0.1,
        min_sampled_share: float = MIN_SAMPLED_SHARE,
        cpus: Collection[int] = (),
        restart_delay_s: float = 1.0,
        max_restart_delay_s: float = 60.0,
    ) -> None:
        if max_queued_jobs <= 0:
            raise ValueError("max_queued_jobs must be positive")
        self._version_dir = version_dir
        # The worker's log rolls its files as the server's does (`ExperimentLog` keywords).
        rolling = dict(log_rolling or {})
        self._config = (
            "config",
            log_prefix,
            replica_id,
            flush_interval_s,
            pass_interval_s,
            rolling,
        )
        self.max_queued_jobs = max_queued_jobs
        if not 0 < min_sampled_share <= 1:
            raise ValueError("min_sampled_share must be in (0, 1]")
        self.min_sampled_share = min_sampled_share
        self.cpus = frozenset(cpus)  # empty: the worker runs where the server may
        self._restart_delay_s = restart_delay_s
        self._max_restart_delay_s = max_restart_delay_s
        self._transport: asyncio.Transport | None = None
        self._accepting = False
        self._unsent: list[bytes] = []  # written while the socket is being connected
        self._announced: set[tuple[str, str]] = set()
        self._unknown: set[tuple[str, str]] = set()
        self._in_flight: dict[str, int] = {}
        self.in_flight = 0
        self._new_drops: dict[str, int] = {}
        self._unlogged_drops: dict[str, int] = {}
        self._drops_logged_s = time.monotonic()
        self.sampled_share = 1.0
        """The share of entities shadowed now: 1 unless the worker fell behind."""
        self._share_changed_s = time.monotonic()
        self._kept_up_since_s: float | None = None
        self.contended = False
        """Whether the worker's CPU was contended over the last window (see the module)."""
        self._cpu_window: list[float] = [time.monotonic(), 0, 0]  # start, run ns, wait ns
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = False
        self.worker_pid: int | None = None
        self.submitted = 0
        self.dropped = 0
        self.completed = 0
        self.failed = 0
        self.decision_flips = 0
        self.worker_exits = 0

    @property
    def full(self) -> bool:
        """True when the next job would be dropped (jobs in flight at the bound, or no worker)."""
        return bool(self.full_reason)

    @property
    def full_reason(self) -> str:
        """Why the next job would be dropped ("queue full" or "no worker"); "" when it would not.
        `submit` adds "not loaded" and "unencodable"."""
        if not self._accepting or self._closing:
            return "no worker"
        return "queue full" if self.in_flight >= self.max_queued_jobs else ""

    def drop(self, model: str, jobs: int = 1, reason: str = "queue full") -> None:
        """Count dropped jobs; this is all a full queue costs the server."""
        self.dropped += jobs
        self._new_drops[model] = self._new_drops.get(model, 0) + jobs
        self._unlogged_drops[reason] = self._unlogged_drops.get(reason, 0) + jobs

    def take_drops(self) -> dict[str, int]:
        """Jobs dropped per model since the last call (to feed a metric off the hot path)."""
        drops, self._new_drops = self._new_drops, {}
        return drops

    def log_drops(self, *, now_or_never: bool = False) -> None:
        """Log the drops since the last line, by reason, at most once per DROP_LOG_INTERVAL_S
        (`now_or_never`: whatever the interval, as the server closes)."""
        now = time.monotonic()
        if not self._unlogged_drops:
            return
        if not now_or_never and now - self._drops_logged_s < DROP_LOG_INTERVAL_S:
            return
        drops, self._unlogged_drops = self._unlogged_drops, {}
        reasons = ", ".join(f"{reason}: {jobs:,}" for reason, jobs in sorted(drops.items()))
        _log.warning(
            "%s shadow copies dropped in the last %.0f s (%s)",
            f"{sum(drops.values()):,}",
            now - self._drops_logged_s,
            reasons,
        )
        self._drops_logged_s = now

    def adjust_share(self) -> None:
        """Halve the sampled share while the worker is behind; double it once it keeps up.

        Called as jobs are submitted and acknowledged; a comparison or two when nothing moves.
        """
        now = time.monotonic()
        if self.in_flight * 2 >= self.max_queued_jobs or self.contended:
            self._kept_up_since_s = None
            if (
                self.sampled_share > self.min_sampled_share
                and now - self._share_changed_s >= SHARE_DOWN_S
            ):
                self._set_share(max(self.sampled_share / 2, self.min_sampled_share), now)
        elif self.sampled_share < 1.0 and self.in_flight * 4 <= self.max_queued_jobs:
            if self._kept_up_since_s is None:
                self._kept_up_since_s = now
            elif now - max(self._kept_up_since_s, self._share_changed_s) >= SHARE_UP_S:
                self._set_share(min(self.sampled_share * 2, 1.0), now)
                self._kept_up_since_s = None

    def _set_share(self, share: float, now: float) -> None:
        behind = share < self.sampled_share
        self.sampled_share, self._share_changed_s = share, now
        if behind:
            why = (
                "no CPU to spare on this machine"
                if self.contended and self.in_flight * 2 < self.max_queued_jobs
                else f"{self.in_flight} jobs in flight"
            )
            _log.warning(
                "shadow worker behind (%s): shadowing the entities of a %s share "
                "(chosen by entity hash)",
                why,
                _fraction(share),
            )
        elif share < 1.0:
            _log.info(
                "shadow worker keeping up: shadowing the entities of a %s share", _fraction(share)
            )
        else:
            _log.info("shadow worker keeping up: shadowing every entity again")

    def observe_cpu(self, run_ns: int, wait_ns: int, now: float | None = None) -> None:
        """The worker's thread ran `run_ns` and waited to run `wait_ns` since its last report:
        decide, once a window, whether its CPU is contended."""
        now = time.monotonic() if now is None else now
        window = self._cpu_window
        window[1] += run_ns
        window[2] += wait_ns
        if now - window[0] < CONTENTION_WINDOW_S:
            return
        run, wait = window[1], window[2]
        if run + wait >= _MIN_WINDOW_NS:
            if wait > CONTENDED_WAIT * run:
                self.contended = True
            elif wait < UNCONTENDED_WAIT * run:
                self.contended = False
        else:  # it hardly ran or waited: nothing to shed
            self.contended = False
        self._cpu_window = [now, 0, 0]

    def roll(self) -> None:
        """Have the worker publish its open log files now (after what it has been sent)."""
        if self._accepting and not self._closing:
            self._write(frame(("roll",)))

    def forget(self, model: str, version: str) -> None:
        """`version`'s files changed (a reload in place): announce it again before its next
        job, so the worker loads the new files instead of scoring with the old."""
        self._announced.discard((model, version))
        self._unknown.discard((model, version))

    def submit(self, job: ShadowJob) -> bool:
        """Send a job without waiting; False (and counted) when full, closed or not loaded."""
        reason = self.full_reason
        if reason or not self._announce(job):
            self.drop(job.model, reason=reason or "not loaded")
            self.adjust_share()
            return False
        try:
            data = encode_job(job)
        except Exception:  # a shadow copy must never fail the request it copies
            _log.exception("shadow copy of %s dropped: it cannot be encoded", job.model)
            self.drop(job.model, reason="unencodable")
            return False
        if self._supervisor is None:
            self._start_worker()
        self._write(data)
        self.submitted += 1
        self.in_flight += 1
        self._in_flight[job.model] = self._in_flight.get(job.model, 0) + 1
        if self.in_flight * 2 >= self.max_queued_jobs:
            self.adjust_share()
        return True

    def start(self) -> None:
        """Accept jobs from now on; the worker process starts with the first one, so a server
        whose experiments shadow nothing runs none. Call inside the running event loop."""
        if not self._closing and self._supervisor is None:
            self._begin_worker()

    def _start_worker(self) -> None:
        self._supervisor = asyncio.get_running_loop().create_task(
            self._supervise(), name="shadow-supervisor"
        )

    async def close(self, timeout_s: float = 5.0) -> None:
        """Refuse new jobs; let the worker score, log and acknowledge what it has, then exit.

        Jobs not acknowledged within `timeout_s` are counted as dropped (the worker is killed).
        """
        self._closing = True
        supervisor = self._supervisor
        if supervisor is None:
            return
        if not self._accepting:  # no worker holds accepted jobs (it died; they are counted)
            self._kill()
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
            return
        if self._transport is not None:  # else the worker being started gets the end of input
            self._transport.write_eof()
        done, _ = await asyncio.wait({supervisor}, timeout=timeout_s)
        if not done:
            _log.warning("shadow worker did not finish within %.1f s; killing it", timeout_s)
            self._kill()
            await asyncio.wait({supervisor})
        self._lose_in_flight()

    def _begin_worker(self) -> None:
        self._accepting = True
        self._announced = set()
        self._unsent = [frame(self._config)]

    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)
        else:
            self._unsent.append(data)

    def _announce(self, job: ShadowJob) -> bool:
        for version in (job.champion_version, *job.versions):
            key = (job.model, version)
            if key in self._announced:
                continue
            try:
                model_dir = self._version_dir(*key)
            except Exception:
                if key not in self._unknown:
                    self._unknown.add(key)
                    _log.warning("shadow copies of %s dropped: version %s is not loaded", *key)
                return False
            self._write(frame(("version", job.model, version, str(model_dir))))
            self._announced.add(key)
        return True

    def _on_message(self, message: tuple[Any, ...]) -> None:
        if message[0] != "done":
            raise ValueError(f"unexpected message from the shadow worker: {message[0]!r}")
        _, completed, failed, flips, run_ns, wait_ns = message
        for counts in (completed, failed):
            for model, jobs in counts.items():
                self._in_flight[model] = self._in_flight.get(model, 0) - jobs
                self.in_flight -= jobs
        self.completed += sum(completed.values())
        self.failed += sum(failed.values())
        self.decision_flips += flips
        self.observe_cpu(run_ns, wait_ns)
        self.adjust_share()

    def _lose_in_flight(self) -> None:
        for model, jobs in self._in_flight.items():
            if jobs > 0:
                self.drop(model, jobs, reason="no worker")
        self._in_flight.clear()
        self.in_flight = 0

    def _kill(self) -> None:
        if self.worker_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.worker_pid, signal.SIGKILL)

    async def _supervise(self) -> None:
        delay_s = self._restart_delay_s
        while True:
            if not self._accepting:
                if self._closing:
                    return
                self._begin_worker()
            started = time.monotonic()
            try:
                code: int | None = await self._run_worker()
            except Exception:
                _log.exception("shadow worker failed")
                code = None
            self._accepting = False  # what was written for this worker is lost with it
            if self._closing:
                self._lose_in_flight()
                return
            self.worker_exits += 1
            lost = self.in_flight
            self._lose_in_flight()
            if time.monotonic() - started > self._max_restart_delay_s:
                delay_s = self._restart_delay_s
            _log.error(
                "shadow worker exited (status %s); %d jobs in flight counted as dropped; "
                "restarting in %.0f s",
                code,
                lost,
                delay_s,
            )
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, self._max_restart_delay_s)

    async def _run_worker(self) -> int:
        # The socket is connected before the process exists: jobs accepted meanwhile wait in it.
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        with theirs:
            try:
                transport, protocol = await loop.create_unix_connection(
                    lambda: _WorkerProtocol(self._on_message), sock=ours
                )
            except BaseException:
                ours.close()
                raise
            transport.writelines(self._unsent)
            self._unsent = []
            self._transport = transport
            try:
                pid = await self._spawn(theirs)
            except BaseException:
                self._accepting = False
                self._transport = None
                transport.close()
                raise
            if self._closing:
                transport.write_eof()
        self.worker_pid = pid
        _log.info("shadow worker %d started", pid)
        try:
            await protocol.lost
        finally:
            self._accepting = False
            self._transport = None
            transport.close()
            code = await self._reap(pid)
            self.worker_pid = None
        return code

    async def _spawn(self, sock: socket.socket) -> int:
        sock.set_inheritable(True)
        argv = [sys.executable, "-m", "service.shadow.worker", "--fd", str(sock.fileno())]
        # posix_spawn, not fork: this process runs gRPC and engine threads.
        pid = await asyncio.to_thread(os.posix_spawn, sys.executable, argv, os.environ, setsid=True)
        lower_priority(pid)  # before the new interpreter has done much at normal priority
        if self.cpus:
            restrict_cpus(pid, self.cpus)
        return pid

    async def _reap(self, pid: int) -> int:
        # The worker closes its socket only when it exits; make sure of it, then collect it.
        waiter = asyncio.ensure_future(asyncio.to_thread(os.waitpid, pid, 0))
        done, _ = await asyncio.wait({waiter}, timeout=10.0)
        if not done:
            self._kill()
        _, status = await waiter
        return os.waitstatus_to_exitcode(status)


def sampled(share: float, model: str, entity_id: str, request_id: str) -> bool:
    """Whether a row is in the sampled `share`: by its entity's hash (its request id's for a
    request that names no entity), the same in every process; the entities of a smaller share
    are among those of every larger one."""
    return stable_unit_interval("shadow-sample", model, entity_id or request_id) < share


def _fraction(share: float) -> str:
    return f"1/{round(1 / share)}"
