"""`Watchdog`: an engine wrapper that gives up on a call that runs past a time limit.

A Python thread cannot be killed, so a hung engine call (a stuck CUDA stream, a deadlocked
driver) would hold the batcher's thread and every request in its batch until the client's
deadline. The watchdog runs each call on a thread of its own (daemon, so a stuck one never blocks
process exit) and waits at most `timeout_s`; past that it raises `EngineHung`, which the pool
answers by taking the engine out of service at once and serving the batch from the fallback.

Trade-offs: every call pays one thread hand-off (tens of microseconds), which is why only the
primary engines are wrapped and the fallback runs inline; a hung call keeps its thread (at most
`max_concurrency` of them, since a hung engine gets no more calls); the engine stays out of
service until its model version is reloaded.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from engines.base import Engine, EngineHung, EngineUnavailable, Profile

__all__ = ["Watchdog"]

Arrays = Mapping[str, np.ndarray]
_Call = tuple[Callable[[Arrays], dict[str, np.ndarray]], Arrays, Future]
# Put on the queue once for each thread at shutdown: the thread that takes it ends.
_STOP: Any = None


class _DaemonWorkers:
    """A few daemon threads that run calls from one queue; grows while every thread is busy."""

    def __init__(self, limit: int, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._limit = limit
        self._name = name

    def submit(self, fn: Callable[[Arrays], dict[str, np.ndarray]], inputs: Arrays) -> Future:
        future: Future = Future()
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
            elif self._threads < self._limit:
                self._threads += 1
                threading.Thread(
                    target=self._work, name=f"{self._name}-{self._threads}", daemon=True
                ).start()
        self._calls.put((fn, inputs, future))
        return future

    def shutdown(self) -> None:
        """End the threads once they are idle (a hung one ends if its call ever returns): a
        retired model version's engine left them waiting on the queue for good."""
        with self._lock:
            threads, self._limit = self._threads, 0
        for _ in range(threads):
            self._calls.put(_STOP)

    def _work(self) -> None:
        while (call := self._calls.get()) is not _STOP:
            fn, inputs, future = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(inputs))
                except BaseException as exc:  # handed to the waiting caller
                    future.set_exception(exc)
            del call, fn, inputs, future  # a thread waiting holds no engine or arrays
            with self._lock:
                self._idle += 1


class Watchdog(Engine):
    """`engine` with a limit on each call; looks like the engine it wraps (name, profiles)."""

    def __init__(self, engine: Engine, timeout_s: float) -> None:
        self.inner = engine
        self.timeout_s = timeout_s
        self.name = engine.name
        self.kind = engine.kind
        self.precision = engine.precision
        self.profiles = engine.profiles
        self.max_concurrency = engine.max_concurrency
        # One spare thread, so a call can start while a hung one still holds its thread.
        self._workers = _DaemonWorkers(engine.max_concurrency + 1, f"watchdog-{engine.name}")
        self.hung = False
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def select_profile(self, shapes: Mapping[str, tuple[int, ...]]) -> Profile:
        return self.inner.select_profile(shapes)

    def infer(self, inputs: Arrays) -> dict[str, np.ndarray]:
        if self._closed:
            raise EngineUnavailable(f"{self.name} is closed")
        if self.hung:
            raise EngineHung(f"{self.name}: an earlier call is still running past its limit")
        future = self._workers.submit(self.inner.infer, inputs)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self.hung = True
            raise EngineHung(
                f"{self.name}: no result within {self.timeout_s * 1000:.0f} ms"
            ) from None

    def _infer(self, inputs: Arrays, profile: Profile) -> dict[str, np.ndarray]:
        raise NotImplementedError  # infer() delegates whole calls to the wrapped engine

    def close(self) -> None:
        self._closed = True
        self._workers.shutdown()
        self.inner.close()
