"""Client-side adaptive throttling, as the Google SRE book's "Handling Overload" describes it.

Each client keeps, over the last `window_s` seconds, how many calls it made (`requests`:
those that ended, and those it refused itself) and how many the server accepted (`accepts`:
answered with anything but an overload status). A call counts when it ends, so a burst of calls
in flight on a healthy server is never mistaken for calls refused. While the server accepts
them all, every call goes out. Once it refuses more than 1 in `k`, the client refuses a share
of new calls itself, before they cost the network or the server anything, with the
probability

    max(0, (requests - k * accepts) / (requests + 1))

so that about `k` times what the server accepts still reaches it, enough to see at once when it
recovers. Below `min_requests` in the window it never throttles: a handful of failures (the
calls in flight when a server restarts) says nothing about overload, and throttling on them
would refuse the first calls to the server that comes back. A call refused here fails at once
with RESOURCE_EXHAUSTED and a message saying so; it counts as a request, so a client that keeps
asking keeps being throttled until the server accepts again. Nothing is retried.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc

__all__ = ["OVERLOAD_CODES", "AdaptiveThrottle"]

# What an overloaded server (or the front that sheds for it) answers: not accepted.
OVERLOAD_CODES = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


class AdaptiveThrottle:
    """`allow()` before a call, `record(code)` after it; safe from any thread."""

    def __init__(
        self,
        k: float = 2.0,
        window_s: float = 120.0,
        min_requests: int = 20,
        *,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        if k < 1 or window_s <= 0:
            raise ValueError("k must be at least 1 and window_s positive")
        self.k = k
        self.window_s = window_s
        self.min_requests = min_requests
        self._clock = clock
        self._draw = draw
        self._lock = threading.Lock()
        # One [second, requests, accepts] per second with calls, oldest first.
        self._seconds: deque[list[int]] = deque()
        self._requests = 0
        self._accepts = 0
        self.throttled = 0
        """Calls refused by the client itself so far."""

    def counts(self) -> tuple[int, int]:
        """(requests, accepts) over the window."""
        with self._lock:
            self._expire(int(self._clock()))
            return self._requests, self._accepts

    def rejection_probability(self) -> float:
        return self._probability(*self.counts())

    def _probability(self, requests: int, accepts: int) -> float:
        if requests < self.min_requests:
            return 0.0
        return max(0.0, (requests - self.k * accepts) / (requests + 1))

    def allow(self) -> bool:
        """Whether to send the next call; one refused here counts as a request at once."""
        with self._lock:
            now = int(self._clock())
            self._expire(now)
            p = self._probability(self._requests, self._accepts)
            if p > 0 and self._draw() < p:
                self._bucket(now)[1] += 1
                self._requests += 1
                self.throttled += 1
                return False
            return True

    def record(self, code: grpc.StatusCode) -> None:
        """The status a sent call ended with: a request, and an accept unless it is an
        overload status."""
        accepted = code not in OVERLOAD_CODES
        with self._lock:
            now = int(self._clock())
            self._expire(now)
            bucket = self._bucket(now)
            bucket[1] += 1
            self._requests += 1
            if accepted:
                bucket[2] += 1
                self._accepts += 1

    def refusal(self) -> str:
        """The message of a call the client refused."""
        requests, accepts = self.counts()
        return (
            f"throttled by the client: the server accepted {accepts:,} of the last {requests:,} "
            f"calls in {self.window_s:g} s (adaptive throttling; nothing was sent)"
        )

    def _bucket(self, now: int) -> list[int]:
        if not self._seconds or self._seconds[-1][0] != now:
            self._seconds.append([now, 0, 0])
        return self._seconds[-1]

    def _expire(self, now: int) -> None:
        while self._seconds and self._seconds[0][0] <= now - self.window_s:
            _, requests, accepts = self._seconds.popleft()
            self._requests -= requests
            self._accepts -= accepts
