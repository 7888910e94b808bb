"""`ShadowRunner` with its real worker process and real ONNX Runtime on small models."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pyarrow.dataset as pads
import pytest
from modelkit import write_sequence_model
from waiting import until, wait_until

from engines.onnxrt import OnnxRuntimeEngine
from service.batching.rows import MAX_PADDING
from service.shadow import ExperimentLog, ShadowJob, ShadowRunner
from service.shadow import runner as runner_module
from service.shadow.channel import encode_job, frame
from service.shadow.log import read_spool
from service.shadow.runner import MIN_SAMPLED_SHARE, sampled
from service.shadow.scorer import MAX_LOADED_VERSIONS, ChallengerScorer
from service.shadow.worker import serve

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


def test_a_pass_runs_rows_grouped_by_history_length_with_bounded_padding(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    calls: list[tuple[int, int, float]] = []  # rows, padded length, real history rows
    infer = OnnxRuntimeEngine.infer

    def recording(self: OnnxRuntimeEngine, inputs: dict[str, np.ndarray]) -> object:
        mask = inputs["history_mask"]
        calls.append((mask.shape[0], mask.shape[1], float(mask.sum())))
        return infer(self, inputs)

    monkeypatch.setattr(OnnxRuntimeEngine, "infer", recording)
    log = ExperimentLog(str(tmp_path), replica_id="t", flush_interval_s=0.05).start()
    scorer = ChallengerScorer(log, max_rows_per_call=8)
    for version in ("1", "2"):
        scorer.add_version(MODEL, version, models / MODEL / version)
    # One long history among many short ones, all in one pass.
    jobs = [job(0, length=16)] + [job(i, rows=2, length=1 + i % 3) for i in range(1, 20)]
    outcome = scorer.score(jobs)
    scorer.close()
    log.close()
    assert outcome.completed == {MODEL: 20} and not outcome.failed
    assert sum(rows for rows, _, _ in calls) == 39
    for rows, length, real in calls:
        assert rows <= 8
        assert rows == 1 or rows * length <= MAX_PADDING * real
    assert max(length for rows, length, _ in calls if rows > 1) < 16  # the long row ran apart
    logged = {r["request_id"]: r["score"] for r in records(tmp_path)}
    for j in jobs:  # each row scored as if alone, whatever it was grouped with
        for request_id, score in zip(j.request_ids, direct(models / MODEL / "2", j), strict=True):
            assert logged[request_id] == pytest.approx(float(score), abs=1e-6)


def test_the_worker_keeps_the_sessions_of_the_versions_it_scored_last(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Challengers rotated one after another: past MAX_LOADED_VERSIONS the session scored
    longest ago is closed, and a version shadowed again is loaded again from its folder."""
    closed: list[str] = []
    close = OnnxRuntimeEngine.close

    def recording(self: OnnxRuntimeEngine) -> None:
        closed.append(self.name)
        close(self)

    monkeypatch.setattr(OnnxRuntimeEngine, "close", recording)
    log = ExperimentLog(str(tmp_path), replica_id="t", flush_interval_s=0.05).start()
    scorer = ChallengerScorer(log)
    versions = [str(v) for v in range(3, 3 + MAX_LOADED_VERSIONS + 2)]
    for version in ("1", *versions):
        scorer.add_version(MODEL, version, models / MODEL / "2")  # the same files each
    for i, version in enumerate(versions):
        assert scorer.score([job(i, versions=(version,))]).completed == {MODEL: 1}
    assert len(closed) == 2  # the two scored first
    assert scorer.score([job(99, versions=(versions[0],))]).completed == {MODEL: 1}
    assert len(closed) == 3
    scorer.close()
    log.close()
    assert len(closed) == 3 + MAX_LOADED_VERSIONS


def test_a_worker_behind_halves_the_sampled_share_and_doubles_it_once_caught_up(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(runner_module, "SHARE_DOWN_S", 0.0)
    monkeypatch.setattr(runner_module, "SHARE_UP_S", 0.0)

    async def scenario() -> list[float]:
        runner = runner_for(models, tmp_path, max_queued_jobs=8)
        runner.start()
        assert runner.submit(job(0))
        await until(lambda: runner.completed == 1)  # the worker runs
        pid = runner.worker_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            shares = []
            for i in range(1, 6):  # half the bound in flight from the fourth on: behind
                assert runner.submit(job(i))
                shares.append(runner.sampled_share)
        finally:
            os.kill(pid, signal.SIGCONT)
        await until(lambda: runner.completed == 6)
        for _ in range(6):  # caught up: the share doubles back (its acks may have begun it)
            runner.adjust_share()
            shares.append(runner.sampled_share)
        await runner.close(timeout_s=30)
        return shares

    with caplog.at_level("INFO", logger="service.shadow.runner"):
        shares = asyncio.run(scenario())
    assert shares[:5] == [1.0, 1.0, 1.0, 0.5, 0.25]
    after = list(dict.fromkeys(shares[5:]))
    assert after[-1] == 1.0 and all(b == 2 * a for a, b in itertools.pairwise(after))
    lines = [r.getMessage() for r in caplog.records if "shadowing" in r.getMessage()]
    assert "behind" in lines[0] and "shadowing the entities of a 1/2 share" in lines[0]
    assert "1/4 share" in lines[1]
    assert lines[-1] == "shadow worker keeping up: shadowing every entity again"


def test_the_sample_is_nested_and_its_size_follows_the_share():
    entities = [f"e{i}" for i in range(20_000)]
    taken = {
        share: {e for e in entities if sampled(share, "m", e, "request")}
        for share in (1.0, 0.5, 0.25, MIN_SAMPLED_SHARE)
    }
    assert taken[1.0] == set(entities)
    assert taken[MIN_SAMPLED_SHARE] <= taken[0.25] <= taken[0.5]  # a smaller share's are kept
    for share in (0.5, 0.25, MIN_SAMPLED_SHARE):
        assert len(taken[share]) == pytest.approx(share * len(entities), rel=0.1)
    # A request that names no entity is drawn by its request id.
    assert sampled(0.5, "m", "", "r1") == sampled(0.5, "m", "r1", "other")


def test_drops_are_logged_by_reason_at_most_once_an_interval(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    runner = runner_for(models, tmp_path)
    runner.drop(MODEL, 3, reason="queue full")
    runner.drop(MODEL, 2, reason="no worker")
    with caplog.at_level("WARNING", logger="service.shadow.runner"):
        runner.log_drops()  # within the interval since the runner began: not yet
        assert not caplog.records
        monkeypatch.setattr(runner_module, "DROP_LOG_INTERVAL_S", 0.0)
        runner.log_drops()
        runner.log_drops()  # nothing new: no line
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("5 shadow copies dropped in the last")
    assert "(no worker: 2, queue full: 3)" in line


def test_a_worker_short_of_cpu_halves_the_share_before_its_queue_grows(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(runner_module, "SHARE_DOWN_S", 0.0)
    runner = runner_for(models, tmp_path)
    start = time.monotonic()
    ms = 1_000_000
    runner.observe_cpu(100 * ms, 20 * ms, now=start + 0.5)  # within the window: no verdict
    assert not runner.contended
    runner.observe_cpu(100 * ms, 120 * ms, now=start + 1.5)  # waited 0.7 of its run time
    assert runner.contended
    with caplog.at_level("WARNING", logger="service.shadow.runner"):
        runner.adjust_share()
    assert runner.sampled_share == 0.5 and runner.in_flight == 0
    assert "no CPU to spare on this machine" in caplog.records[-1].getMessage()
    runner.observe_cpu(300 * ms, 90 * ms, now=start + 3.0)  # 0.3: between the bounds, holds
    assert runner.contended
    runner.observe_cpu(300 * ms, 30 * ms, now=start + 4.5)  # 0.1: free again
    assert not runner.contended
    runner.observe_cpu(2 * ms, 5 * ms, now=start + 6.0)  # hardly ran: nothing to judge by
    assert not runner.contended


def test_a_roll_publishes_the_records_of_the_jobs_sent_before_it(models: Path, tmp_path: Path):
    ours, theirs = socket.socketpair()
    worker = threading.Thread(target=serve, args=(theirs,), daemon=True)
    worker.start()
    shadow = job(0, rows=3)
    hour_s = 3600.0  # no file rolls by age: only the roll publishes
    ours.sendall(
        frame(("config", str(tmp_path), "w-shadow", 0.05, 0.01, {"max_file_age_s": hour_s}))
        + b"".join(frame(("version", MODEL, v, str(models / MODEL / v))) for v in ("1", "2"))
        + encode_job(shadow)
        + frame(("roll",))
    )  # one pass: the job, then the roll

    def published() -> list[str]:
        files = [str(p) for p in tmp_path.rglob("*.parquet") if "_spool" not in p.parts]
        if not files:
            return []
        return sorted(pads.dataset(files, format="parquet").to_table()["request_id"].to_pylist())

    wait_until(lambda: published() == sorted(shadow.request_ids), timeout_s=20)
    ours.close()  # end of input: the worker finishes and returns
    worker.join(30)
    theirs.close()
    assert not worker.is_alive() and published() == sorted(shadow.request_ids)
