"""The shadow worker's CPU priority and CPUs: the lowest priority the kernel offers to an
unprivileged user, and, where configured, cores of its own."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection

__all__ = ["lower_priority", "restrict_cpus"]

_log = logging.getLogger(__name__)


def lower_priority(pid: int = 0) -> None:
    """Idle scheduling class and nice 19 for `pid` (0: this process); best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 19)
        if hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        _log.warning("shadow worker %d keeps its CPU priority: %s", pid or os.getpid(), exc)


def restrict_cpus(pid: int, cpus: Collection[int]) -> None:
    """Let `pid` (0: this process) run only on `cpus`; best effort, as its priority is.

    Like the priority, the mask is set on the process's one thread right after it is spawned,
    so the threads it starts later inherit it."""
    try:
        os.sched_setaffinity(pid, cpus)
    except OSError as exc:
        _log.warning(
            "shadow worker %d keeps the server's CPUs (asked for %s): %s",
            pid or os.getpid(),
            sorted(cpus),
            exc,
        )
