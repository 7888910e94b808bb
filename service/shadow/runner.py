"""`ShadowRunner`: hand shadow jobs to a separate, lowest-priority worker process.

The server's only work per job is `submit`: encode the validated arrays (about 2 µs) and a
non-blocking write to a socket pair. When `max_queued_jobs` jobs are in flight (written and not
yet acknowledged, wherever they are: the socket, the worker's pass, its engine), the next job
is dropped and counted: a comparison and two integer increments. The worker
(`service.shadow.worker`) scores, logs the challenger records as its own replica under the
same log prefix, and acknowledges with counts, which the event loop reads without blocking.

If the worker dies, its jobs in flight are counted as dropped and a new one is started after a
back-off; the champion never waits on any of this.
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
from service.shadow.job import ShadowJob
from service.shadow.priority import lower_priority, restrict_cpus

__all__ = ["ShadowRunner"]

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
        return self.in_flight >= self.max_queued_jobs or not self._accepting or self._closing

    def drop(self, model: str, jobs: int = 1) -> None:
        """Count dropped jobs; this is all a full queue costs the server."""
        self.dropped += jobs
        self._new_drops[model] = self._new_drops.get(model, 0) + jobs

    def take_drops(self) -> dict[str, int]:
        """Jobs dropped per model since the last call (to feed a metric off the hot path)."""
        drops, self._new_drops = self._new_drops, {}
        return drops

    def forget(self, model: str, version: str) -> None:
        """`version`'s files changed (a reload in place): announce it again before its next
        job, so the worker loads the new files instead of scoring with the old."""
        self._announced.discard((model, version))
        self._unknown.discard((model, version))

    def submit(self, job: ShadowJob) -> bool:
        """Send a job without waiting; False (and counted) when full, closed or not loaded."""
        if self.full or not self._announce(job):
            self.drop(job.model)
            return False
        try:
            data = encode_job(job)
        except Exception:  # a shadow copy must never fail the request it copies
            _log.exception("shadow copy of %s dropped: it cannot be encoded", job.model)
            self.drop(job.model)
            return False
        if self._supervisor is None:
            self._start_worker()
        self._write(data)
        self.submitted += 1
        self.in_flight += 1
        self._in_flight[job.model] = self._in_flight.get(job.model, 0) + 1
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
        _, completed, failed, flips = message
        for counts in (completed, failed):
            for model, jobs in counts.items():
                self._in_flight[model] = self._in_flight.get(model, 0) - jobs
                self.in_flight -= jobs
        self.completed += sum(completed.values())
        self.failed += sum(failed.values())
        self.decision_flips += flips

    def _lose_in_flight(self) -> None:
        for model, jobs in self._in_flight.items():
            if jobs > 0:
                self.drop(model, jobs)
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
