"""Process and thread settings through Linux's prctl(2): a no-op where the call is missing."""

from __future__ import annotations

import contextlib
import ctypes

__all__ = ["PR_SET_NAME", "PR_SET_PDEATHSIG", "prctl"]

PR_SET_PDEATHSIG = 1  # the signal this process gets when the thread that started it ends
PR_SET_NAME = 15  # the calling thread's name, at most 15 bytes


def prctl(option: int, value: int | bytes) -> None:
    """Call prctl(option, value); where the C library or the option is missing, do nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
