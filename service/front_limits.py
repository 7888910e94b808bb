"""How many scoring calls the front lets each worker hold: sized from what the worker finishes.

A worker answers a call in about (calls it holds) / (calls it finishes a second). The front
queues the rest for a quarter of the budget, so what a worker holds must be finished within
the rest of the budget's usable part: `target_s`. How many calls that is depends on the
machine: a worker alone on a fast core finishes two or three times what it finishes sharing a
core with HAProxy and a load client, so no fixed number suits both. Eight calls a worker are
right on one shared core (docs/benchmarks.md, "Overload"); on two, the same eight left a worker
idle while callers waited in the front, and the front answered 0.81 of the calls a second that
the worker answered when reached directly.

So when `RISKSERVE_MAX_REQUESTS_IN_PROGRESS` is 0 (the default), the process that supervises
the front reads each worker's finished calls from HAProxy every 50 ms (its runtime API, on a
Unix socket in the front's private folder) and sizes the worker's limit from them. Calls the
worker refused are left out: HAProxy counts them apart (an error status with no message, gRPC's
trailers-only answer), and a quick refusal is no measure of what the worker finishes. A worker
found full (holding its limit, or calls waiting in the queue) at two polls in a row gets what
it finished a second in between times `target_s` (Little's law), up or down. One with room to
spare keeps its limit or gets more, never less, so a capacity it once showed is there for the
next burst.

A worker starts with the calls it admits itself, as a lone server would take them, so a step
in load meets no limit still to be learnt; a worker on a shared core is brought down at its
second full poll in a row. Starting at 15, the front refused calls when 16 callers started at
once against a worker that answered them all within 10 ms when reached directly. A batching
worker frees its calls a batch at a time, so a call over the limit can wait a whole batch in
the queue, longer than the queue time. The limit is never below `DEFAULT_WORKER_CALLS`. A set
value of the setting is used as it is, for every worker.
"""

from __future__ import annotations

import csv
import logging
import math
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from service.api.admission import admission_limit
from service.batching.budget import Budget
from service.config import Settings

__all__ = [
    "DEFAULT_WORKER_CALLS",
    "Calls",
    "Worker",
    "WorkerLimits",
    "queue_timeout_ms",
    "read_refusals",
    "read_stats",
    "runtime_command",
    "target_s",
    "worker_calls",
]

log = logging.getLogger(__name__)

# The least calls a worker's limit comes down to where it is sized from its pace, and the limit
# of every worker in a configuration that nothing sizes (`riskserve front-config`).
DEFAULT_WORKER_CALLS = 8
# The backend whose servers carry the per-worker limit (the scoring calls).
CALLS_BACKEND = "calls"


def queue_timeout_ms(settings: Settings) -> int:
    """How long a call may wait in the front for a free worker: a quarter of the budget, so
    a refusal reaches its caller within 3 ms of a 10 ms budget (HAProxy adds about 0.3 ms)."""
    return max(1, math.floor(settings.budget_ms / 4))


def target_s(settings: Settings) -> float:
    """The time a worker may take for the calls it holds: the budget's usable part less the
    front's queue time (6 ms of a 10 ms budget: 8 usable, 2 of queue)."""
    usable = Budget(settings.budget_s).usable_s
    return max(usable - queue_timeout_ms(settings) / 1e3, usable / 4)


@dataclass(frozen=True)
class Calls:
    """The calls a worker may hold: at least `least`, at most `most`, where it starts."""

    least: int
    most: int


def worker_calls(settings: Settings) -> Calls:
    """What a worker may hold for the settings: the setting, where it is set. Where it is 0,
    at most what the worker admits itself (20 at 10 ms), and at least `DEFAULT_WORKER_CALLS`."""
    if settings.max_requests_in_progress:
        calls = settings.max_requests_in_progress
        return Calls(calls, calls)
    most = admission_limit(Budget(settings.budget_s))
    return Calls(min(DEFAULT_WORKER_CALLS, most), most)


def runtime_command(path: Path, command: str, timeout_s: float = 1.0) -> str:
    """One command to HAProxy's runtime API on its Unix socket; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(str(path))
        conn.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


@dataclass(frozen=True)
class Worker:
    """One worker's row in HAProxy's statistics: calls finished so far, calls it holds now."""

    finished: int
    holding: int


def read_stats(
    stat_csv: str, refused: Mapping[int, int] | None = None
) -> tuple[dict[str, Worker], int]:
    """Each worker of the calls backend, and the calls waiting in its queue, from `show stat`'s
    CSV (its first line is the header, after "# "). `refused`: the calls each worker (by server
    id) refused (`read_refusals`), which are not calls it finished."""
    workers: dict[str, Worker] = {}
    queued = 0
    refused = refused or {}
    for row in csv.DictReader(stat_csv.removeprefix("# ").splitlines()):
        if row.get("pxname") != CALLS_BACKEND:
            continue
        if row["svname"] == "BACKEND":
            queued = int(row["qcur"] or 0)
        elif row["svname"] != "FRONTEND":
            ended = int(row["stot"] or 0) - refused.get(int(row["sid"]), 0)
            workers[row["svname"]] = Worker(max(ended, 0), int(row["scur"] or 0))
    return workers, queued


_TABLE_ENTRY = re.compile(r"\bkey=(\d+)\b.*\bgpc0=(\d+)\b")


def read_refusals(table: str) -> dict[int, int]:
    """The calls each worker refused so far, by server id, from `show table calls` (an entry
    a line, `0x...: key=1 use=0 exp=0 gpc0=3`, once a worker has refused one)."""
    return {int(m[1]): int(m[2]) for m in map(_TABLE_ENTRY.search, table.splitlines()) if m}


@dataclass
class WorkerLimits:
    """Each worker's call limit in the front, kept at what it finishes within `target_s`.

    A worker that is full (it holds its limit, or calls wait in the queue) at two polls in a
    row finished its capacity in between, and its limit becomes what that capacity finishes
    within `target_s`, up or down. One with room to spare finishes what it is sent, which says
    little of what it could: its limit only rises then, so a capacity it once showed stays
    available to the next burst until it is full again and shows another.
    """

    socket_path: Path
    calls: Calls
    target_s: float
    limits: dict[str, int] = field(default_factory=dict)
    _seen: dict[str, Worker] = field(default_factory=dict)
    _full: dict[str, bool] = field(default_factory=dict)
    _seen_at: float = 0.0
    _warned: bool = False

    @classmethod
    def for_settings(cls, settings: Settings, socket_path: Path) -> WorkerLimits | None:
        """The sizing for the settings; None where the setting fixes every worker's limit."""
        if settings.max_requests_in_progress:
            return None
        return cls(socket_path, worker_calls(settings), target_s(settings))

    def limit(self, finished_per_s: float) -> int:
        """A full worker's limit when it finishes `finished_per_s` calls a second."""
        wanted = math.ceil(finished_per_s * self.target_s)
        return min(self.calls.most, max(self.calls.least, wanted))

    def poll(self) -> None:
        """Read what each worker finished since the last poll, and set the limits it calls
        for; HAProxy not answering (starting, stopping) leaves them as they are."""
        try:
            refused = read_refusals(
                runtime_command(self.socket_path, f"show table {CALLS_BACKEND}")
            )
            stats = runtime_command(self.socket_path, "show stat -1 6 -1")
            workers, queued = read_stats(stats, refused)
        except OSError as exc:
            log.debug("front limits: no answer from haproxy (%s)", exc)
            return
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            self._warn_once(f"unreadable statistics from haproxy ({exc!r})")
            return
        now = time.monotonic()
        elapsed, self._seen_at = now - self._seen_at, now
        seen, self._seen = self._seen, workers
        if not seen or elapsed <= 0:
            return
        full_now = {
            name: queued > 0 or worker.holding >= self.current(name)
            for name, worker in workers.items()
        }
        full_before, self._full = self._full, full_now
        # Full at both ends of the interval: what it finished in between is its capacity. Full
        # only now is a step in load, and the interval's rate is still the load before it.
        changes = self.changes(
            (
                name,
                (worker.finished - seen[name].finished) / elapsed,
                full_now[name] and full_before.get(name, False),
            )
            for name, worker in workers.items()
            if name in seen
        )
        if changes:
            self._apply(changes)

    def current(self, name: str) -> int:
        """The limit set for a worker (its most until one was set)."""
        return self.limits.get(name, self.calls.most)

    def changes(self, observed: Iterable[tuple[str, float, bool]]) -> dict[str, int]:
        """The limits that differ from those set, for each worker's calls finished a second
        and whether it was full (it held its limit, or calls waited in the queue)."""
        wanted = {}
        for name, rate, full in observed:
            limit = self.limit(rate) if full else max(self.limit(rate), self.current(name))
            if limit != self.current(name):
                wanted[name] = limit
        return wanted

    def _apply(self, changes: dict[str, int]) -> None:
        command = "; ".join(
            f"set maxconn server {CALLS_BACKEND}/{server} {limit}"
            for server, limit in changes.items()
        )
        try:
            answer = runtime_command(self.socket_path, command)
        except OSError as exc:
            log.debug("front limits: no answer from haproxy (%s)", exc)
            return
        if answer.strip():
            self._warn_once(f"haproxy refused {command!r}: {answer.strip()}")
            return
        self.limits.update(changes)
        log.debug("front limits: %s", changes)

    def _warn_once(self, problem: str) -> None:
        """A problem the next polls would meet again: logged at WARNING the first time, and
        at DEBUG after, so the service keeps its limits and its log stays readable."""
        log.log(
            logging.DEBUG if self._warned else logging.WARNING,
            "front limits: %s; the limits stay as they are",
            problem,
        )
        self._warned = True
