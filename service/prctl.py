"""Process and thread settings through Linux's prctl(2): a no-op where the call is missing."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

__all__ = ["PR_SET_NAME", "PR_SET_PDEATHSIG", "end_with_parent", "prctl"]

PR_SET_PDEATHSIG = 1  # the signal this process gets when the thread that started it ends
PR_SET_NAME = 15  # the calling thread's name, at most 15 bytes


def prctl(option: int, value: int | bytes) -> None:
    """Call prctl(option, value); where the C library or the option is missing, do nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def end_with_parent(parent: int | None = None) -> None:
    """Have the kernel send this process SIGTERM when the process that started it ends, so a
    parent killed outright leaves no child serving on its port (Linux only). `parent`, where
    given, is that process's id: one that ended before this call is found here, and the
    signal is sent at once."""
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
