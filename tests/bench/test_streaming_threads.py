"""bench.streaming's CPU by thread: a process's main thread, its engine threads and the rest."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from bench.streaming import THREAD_KINDS, Point, _thread_seconds, parse_args, point_row, summarize
from service.batching.batcher import _name_os_thread

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="thread names and times: Linux only"
)


def _busy_thread(name: str, cpu_s: float, named: threading.Event, done: threading.Event) -> None:
    """A thread that names itself `name` where the OS shows it, then uses `cpu_s` of CPU."""

    def run() -> None:
        _name_os_thread(name)
        named.set()
        start = time.thread_time()
        while time.thread_time() - start < cpu_s:
            pass
        done.wait(60)

    threading.Thread(target=run, daemon=True).start()


def test_a_process_cpu_is_split_into_main_engine_and_other_threads():
    before = _thread_seconds(os.getpid())
    engine_named, other_named, done = threading.Event(), threading.Event(), threading.Event()
    _busy_thread("engine-m-1-0", 0.2, engine_named, done)
    _busy_thread("event_engine", 0.1, other_named, done)
    assert engine_named.wait(10) and other_named.wait(10)
    start = time.thread_time()
    while time.thread_time() - start < 0.1:
        pass
    # The OS counts thread time in ticks: wait until most of each thread's CPU shows.
    deadline = time.monotonic() + 30
    while True:
        after = _thread_seconds(os.getpid())
        if after["engine"] >= 0.15 and after["other"] - before["other"] >= 0.05:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.01)
    done.set()
    assert set(after) == set(THREAD_KINDS)
    assert after["main"] - before["main"] >= 0.05
    assert before["engine"] == 0.0  # no thread of this process was an engine's before


def test_a_point_shows_its_threads_in_its_row_and_the_summary(capsys):
    threads = {"main": 101.0, "engine": 72.0, "other": 38.0}
    point = Point("riskserve", "streaming", 16, 4968, 3.1, 4.78, 211, 0, "", 281, threads)
    assert "211 CPU-us/req (main 101, engine 72, other 38)" in point_row(point)
    summarize([point], parse_args(["--concurrency", "16"]))
    assert "| riskserve streaming | 4,968 | 4.78 | 211 | 101 / 72 / 38 | 281 | 4,968 (16) |" in (
        capsys.readouterr().out
    )


def test_a_point_without_its_threads_shows_none(capsys):
    point = Point("triton", "unary", 16, 5050, 3.0, 5.26, 186, 0, "", 280)
    assert "186 CPU-us/req  machine" in point_row(point)
    summarize([point], parse_args(["--concurrency", "16"]))
    assert "| triton unary | 5,050 | 5.26 | 186 | - | 280 | 5,050 (16) |" in capsys.readouterr().out
