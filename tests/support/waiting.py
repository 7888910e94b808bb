"""Waiting in a test on what it needs to see, not for a fixed time."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Return once `condition()` holds; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """`until` for synchronous tests (a live server on its own thread, a blocking client)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on `host`:`port` now (a condition to wait on)."""
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) == 0
