"""The shadow worker's CPU priority: the lowest the kernel offers to an unprivileged user."""

from __future__ import annotations

import logging
import os

__all__ = ["lower_priority"]

_log = logging.getLogger(__name__)


def lower_priority(pid: int = 0) -> None:
    """Idle scheduling class and nice 19 for `pid` (0: this process); best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 19)
        if hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        _log.warning("shadow worker %d keeps its CPU priority: %s", pid or os.getpid(), exc)
