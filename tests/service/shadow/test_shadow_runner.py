"""`ShadowRunner` with its real worker process and real ONNX Runtime on small models."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pyarrow.dataset as pads
import pytest
from modelkit import write_sequence_model
from waiting import until

from service.shadow import ShadowJob, ShadowRunner
from service.shadow.log import read_spool

MODEL = "seq-mini"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_sequence_model(root, version="1", seed=1)
    write_sequence_model(root, version="2", seed=2)
    return root


def job(i: int, rows: int = 1, length: int = 3, versions: tuple[str, ...] = ("2",)) -> ShadowJob:
    rng = np.random.default_rng(i)
    return ShadowJob(
        model=MODEL,
        experiment="exp",
        versions=versions,
        request_ids=tuple(f"r{i}-{k}" for k in range(rows)),
        entity_ids=tuple(f"e{i}" for _ in range(rows)),
        inputs={
            "features": rng.normal(size=(rows, 4)).astype(np.float32),
            "history": rng.normal(size=(rows, length, 3)).astype(np.float32),
            "history_mask": np.ones((rows, length), dtype=np.float32),
        },
        champion_scores=np.full(rows, 0.1, dtype=np.float32),
        champion_version="1",
    )


def direct(model_dir: Path, shadow: ShadowJob) -> np.ndarray:
    session = ort.InferenceSession(
        str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    return session.run(["score"], dict(shadow.inputs))[0].reshape(-1)


def runner_for(models: Path, logs: Path, **options: float) -> ShadowRunner:
    def version_dir(model: str, version: str) -> Path:
        path = models / model / version
        if not path.is_dir():
            raise LookupError(version)
        return path

    return ShadowRunner(version_dir, str(logs), replica_id="host-1-shadow", **options)  # type: ignore[arg-type]


def records(logs: Path) -> list[dict[str, object]]:
    table = pads.dataset(logs, format="parquet").to_table().drop_columns(["time"])
    return sorted(table.to_pylist(), key=lambda r: str(r["request_id"]))


def run(scenario: Callable[[], Awaitable[ShadowRunner]]) -> ShadowRunner:
    return asyncio.run(scenario())  # type: ignore[arg-type]


def test_worker_process_scores_merged_jobs_and_logs_each_row(models: Path, tmp_path: Path):
    jobs = [job(i, rows=1 + i % 3, length=1 + i % 5) for i in range(12)]

    async def scenario() -> ShadowRunner:
        runner = runner_for(models, tmp_path)
        runner.start()
        assert all([runner.submit(j) for j in jobs])  # sent together: merged, padded
        await until(lambda: runner.completed == len(jobs))
        pid = runner.worker_pid
        await runner.close(timeout_s=30)
        assert pid is not None and pid != os.getpid()
        return runner

    runner = run(scenario)
    assert (runner.submitted, runner.completed, runner.failed, runner.dropped) == (12, 12, 0, 0)
    assert runner.in_flight == 0 and runner.worker_pid is None
    rows = records(tmp_path)
    expected = {}
    for j in jobs:
        for request_id, score in zip(j.request_ids, direct(models / MODEL / "2", j), strict=True):
            expected[request_id] = float(score)
    assert [r["request_id"] for r in rows] == sorted(expected)  # one record per row, none lost
    assert {
        (r["arm"], r["version"], r["engine"], r["served"], r["replica_id"], r["experiment"])
        for r in rows
    } == {("challenger", "2", "onnxruntime-cpu", False, "host-1-shadow", "exp")}
    for r in rows:
        assert r["score"] == pytest.approx(expected[str(r["request_id"])], abs=1e-6)
        assert r["latency_ms"] > 0
    flips = sum(r["decision"] != "APPROVE" for r in rows)  # the champion said 0.1: APPROVE
    assert runner.decision_flips == flips


def test_full_queue_drops_and_counts_without_sending(models: Path, tmp_path: Path):
    async def scenario() -> ShadowRunner:
        runner = runner_for(models, tmp_path, max_queued_jobs=2)
        runner.start()
        await until(lambda: not runner.full)
        accepted = [runner.submit(job(i)) for i in range(10)]  # no loop turn: no ack can arrive
        assert accepted == [True, True] + [False] * 8 and runner.full
        assert runner.take_drops() == {MODEL: 8} and runner.take_drops() == {}
        await runner.close(timeout_s=30)
        assert not runner.submit(job(99))  # closed: refused and counted
        return runner

    runner = run(scenario)
    assert (runner.submitted, runner.completed, runner.dropped) == (2, 2, 9)
    assert [r["request_id"] for r in records(tmp_path)] == ["r0-0", "r1-0"]


def test_unloaded_version_is_dropped_and_a_failing_one_counted(models: Path, tmp_path: Path):
    async def scenario() -> ShadowRunner:
        runner = runner_for(models, tmp_path)
        runner.start()
        await until(lambda: not runner.full)
        assert not runner.submit(job(0, versions=("7",)))  # not loaded in the server
        assert runner.submit(job(1, length=2))
        broken = job(2)
        broken.inputs.pop("history_mask")  # type: ignore[attr-defined]
        assert runner.submit(broken)  # the challenger cannot run it: failed, contained
        unreadable = job(3)
        unreadable.inputs["features"] = np.full((1, 4), None)  # type: ignore[index]
        assert runner.submit(unreadable)  # the worker cannot decode it: failed, worker lives
        await until(lambda: runner.completed + runner.failed == 3)
        await runner.close(timeout_s=30)
        return runner

    runner = run(scenario)
    assert (runner.completed, runner.failed, runner.dropped, runner.worker_exits) == (1, 2, 1, 0)
    assert [r["request_id"] for r in records(tmp_path)] == ["r1-0"]


def test_dead_worker_counts_its_jobs_as_dropped_and_is_replaced(models: Path, tmp_path: Path):
    async def scenario() -> tuple[ShadowRunner, int, int]:
        runner = runner_for(models, tmp_path, restart_delay_s=0.05, flush_interval_s=0.05)
        runner.start()
        assert runner.submit(job(0))
        # Appended to the open file: a kill -9 no longer loses it (the next worker publishes it).
        await until(lambda: any(read_spool(p).num_rows for p in tmp_path.rglob("*.arrows")))
        first = runner.worker_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert runner.submit(job(1))  # written before the loop learns of the death: lost
        await until(lambda: runner.worker_exits == 1 and runner.worker_pid not in (None, first))
        second = runner.worker_pid
        assert second is not None and runner.submit(job(2))
        await until(lambda: runner.completed == 2)
        await runner.close(timeout_s=30)
        return runner, first, second

    runner, first, second = run(scenario)
    assert first != second
    assert (runner.submitted, runner.completed, runner.dropped, runner.in_flight) == (3, 2, 1, 0)
    assert [r["request_id"] for r in records(tmp_path)] == ["r0-0", "r2-0"]


def test_close_while_the_worker_is_down_returns_at_once(models: Path, tmp_path: Path):
    async def scenario() -> ShadowRunner:
        runner = runner_for(models, tmp_path, restart_delay_s=3600)
        runner.start()
        assert runner.submit(job(0))
        await until(lambda: runner.worker_pid is not None)
        os.kill(runner.worker_pid, signal.SIGKILL)  # type: ignore[arg-type]
        await until(lambda: runner.worker_exits == 1)
        assert runner.full and not runner.submit(job(1))  # down: dropped, counted
        # Waiting out the restart delay or the close timeout would take an hour: the guard
        # fails such a close long before.
        await asyncio.wait_for(runner.close(timeout_s=3600), timeout=60)
        return runner

    runner = run(scenario)
    assert (runner.submitted, runner.completed + runner.dropped, runner.in_flight) == (1, 2, 0)
    assert runner.worker_exits == 1  # no worker was started again to be closed


def _threads_of(pid: int) -> list[int]:
    return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]


def test_worker_runs_at_idle_priority_on_the_cpus_it_is_given(models: Path, tmp_path: Path):
    cpu = max(os.sched_getaffinity(0))  # not the whole mask wherever there are two CPUs or more

    async def scenario() -> tuple[ShadowRunner, set[tuple[int, int, frozenset[int]]]]:
        runner = runner_for(models, tmp_path, cpus=[cpu])  # type: ignore[arg-type]
        runner.start()
        assert runner.submit(job(0))
        await until(lambda: runner.completed == 1)  # its engine (and any threads) are loaded
        pid = runner.worker_pid
        assert pid is not None
        seen = {
            (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid),
             frozenset(os.sched_getaffinity(tid)))
            for tid in _threads_of(pid)
        }  # fmt: skip
        await runner.close(timeout_s=30)
        return runner, seen

    runner, seen = run(scenario)
    assert seen == {(os.SCHED_IDLE, 19, frozenset({cpu}))}  # every thread of the worker
    assert runner.completed == 1 and runner.cpus == frozenset({cpu})
