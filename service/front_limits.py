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
the front reads each worker's finished calls from HAProxy every poll (its runtime API, on a
Unix socket in the front's private folder) and sets the worker's limit to what it finished a
second times `target_s` (Little's law), never below `DEFAULT_WORKER_CALLS` and never above the
calls the worker admits itself. A worker that keeps up finishes what it is sent, so its limit
follows the load and stays above what it holds; a saturated one finishes its capacity, so its
limit becomes the calls it finishes within `target_s`. A set value of the setting is used as
it is, for every worker.
"""

from __future__ import annotations

import csv
import logging
import math
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from service.api.admission import admission_limit
from service.batching.budget import Budget
from service.config import Settings

__all__ = [
    "DEFAULT_WORKER_CALLS",
    "WorkerLimits",
    "queue_timeout_ms",
    "runtime_command",
    "target_s",
    "worker_calls",
]

log = logging.getLogger(__name__)

# Calls one worker holds at least, and at first, when the limit is sized from its pace.
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
    usable = Budget(settings.budget_ms / 1e3).usable_s
    return max(usable - queue_timeout_ms(settings) / 1e3, usable / 4)


def worker_calls(settings: Settings) -> tuple[int, int]:
    """The least and the most calls a worker may hold: both the setting where it is set."""
    if settings.max_requests_in_progress:
        return settings.max_requests_in_progress, settings.max_requests_in_progress
    ceiling = admission_limit(Budget(settings.budget_ms / 1e3))
    return min(DEFAULT_WORKER_CALLS, ceiling), ceiling


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


def _finished(stat_csv: str) -> dict[str, int]:
    """Calls each server of the calls backend has finished, from `show stat`'s CSV."""
    lines = stat_csv.lstrip("# ").splitlines()
    return {
        row["svname"]: int(row["stot"] or 0)
        for row in csv.DictReader(lines)
        if row.get("pxname") == CALLS_BACKEND and row.get("svname") not in (None, "BACKEND")
    }


@dataclass
class WorkerLimits:
    """Each worker's call limit in the front, kept at what it finishes within `target_s`."""

    socket_path: Path
    floor: int
    ceiling: int
    target_s: float
    limits: dict[str, int] = field(default_factory=dict)
    _seen: dict[str, int] = field(default_factory=dict)
    _seen_at: float = 0.0

    @classmethod
    def for_settings(cls, settings: Settings, socket_path: Path) -> WorkerLimits | None:
        """The sizing for the settings; None where the setting fixes every worker's limit."""
        if settings.max_requests_in_progress:
            return None
        floor, ceiling = worker_calls(settings)
        return cls(socket_path, floor, ceiling, target_s(settings))

    def limit(self, finished_per_s: float) -> int:
        """A worker's limit when it finishes `finished_per_s` calls a second."""
        return min(self.ceiling, max(self.floor, math.ceil(finished_per_s * self.target_s)))

    def poll(self) -> None:
        """Read what each worker finished since the last poll, and set the limits it calls
        for; HAProxy not answering (starting, stopping) leaves them as they are."""
        try:
            finished = _finished(runtime_command(self.socket_path, "show stat -1 4 -1"))
        except OSError as exc:
            log.debug("front limits: no answer from haproxy (%s)", exc)
            return
        now = time.monotonic()
        elapsed, self._seen_at = now - self._seen_at, now
        seen, self._seen = self._seen, finished
        if not seen or elapsed <= 0:
            return
        changes = self.changes(
            (server, (count - seen.get(server, count)) / elapsed)
            for server, count in finished.items()
        )
        if changes:
            self._apply(changes)

    def changes(self, rates: Iterable[tuple[str, float]]) -> dict[str, int]:
        """The limits that differ from those set, for each server's calls finished a second."""
        wanted = {server: self.limit(rate) for server, rate in rates}
        return {
            server: limit
            for server, limit in wanted.items()
            if self.limits.get(server, self.floor) != limit
        }

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
            log.warning("front limits: haproxy refused %r: %s", command, answer.strip())
            return
        self.limits.update(changes)
        log.debug("front limits: %s", changes)
