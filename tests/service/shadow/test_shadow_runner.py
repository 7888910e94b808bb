from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads

from engines.manifest import Thresholds
from service.shadow import ExperimentLog, ShadowJob, ShadowRunner

THRESHOLDS = Thresholds(review=0.5, decline=0.8)


def job(i: int, rows: int = 1) -> ShadowJob:
    return ShadowJob(
        model="fraud-demo",
        experiment="fraud-demo",
        versions=("2",),
        request_ids=tuple(f"r{i}-{k}" for k in range(rows)),
        entity_ids=tuple(f"e{i}" for _ in range(rows)),
        inputs={"features": np.full((rows, 3), i / 100.0, dtype=np.float32)},
        champion_scores=np.full(rows, 0.1),
        champion_version="1",
    )


class FakeChallenger:
    """Scores = mean of the features row; waits on a gate so a test controls when work runs."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calls = 0

    async def __call__(
        self, model: str, version: str, inputs: Mapping[str, np.ndarray]
    ) -> tuple[np.ndarray, str, float]:
        self.calls += 1
        await self.gate.wait()
        if inputs["features"][0, 0] == np.float32(0.13):
            raise RuntimeError("challenger engine broke")
        return inputs["features"].mean(axis=1) * 10, "fake-cpu", 0.004


def read(prefix: Path) -> list[dict[str, object]]:
    return pads.dataset(prefix, format="parquet").to_table().drop_columns(["time"]).to_pylist()


def test_full_queue_drops_and_counts_and_close_drains(tmp_path: Path) -> None:
    async def scenario() -> tuple[ShadowRunner, list[ShadowJob], list[bool]]:
        fake = FakeChallenger()
        log = ExperimentLog(str(tmp_path), replica_id="r", flush_interval_s=60)
        dropped: list[ShadowJob] = []
        runner = ShadowRunner(
            fake, log, lambda model, version: THRESHOLDS, max_queued_jobs=3,
            on_drop=dropped.append,
        )  # fmt: skip
        runner.start()
        first = runner.submit(job(0))
        await asyncio.sleep(0)  # the worker takes job 0 and blocks on the gate
        accepted = [first] + [runner.submit(job(i)) for i in range(1, 8)]
        fake.gate.set()
        await runner.close(timeout_s=5)
        log.close()
        return runner, dropped, accepted

    runner, dropped, accepted = asyncio.run(scenario())
    assert accepted == [True, True, True, True, False, False, False, False]
    assert runner.dropped == 4 and [j.request_ids[0] for j in dropped] == [
        "r4-0", "r5-0", "r6-0", "r7-0"
    ]  # fmt: skip
    assert runner.completed == 4 and runner.failed == 0
    rows = sorted(read(tmp_path), key=lambda r: str(r["request_id"]))
    assert [r["request_id"] for r in rows] == ["r0-0", "r1-0", "r2-0", "r3-0"]
    assert {(r["arm"], r["version"], r["engine"], r["served"]) for r in rows} == {
        ("challenger", "2", "fake-cpu", False)
    }
    assert [r["decision"] for r in rows] == ["APPROVE", "APPROVE", "APPROVE", "APPROVE"]
    assert rows[3]["score"] == np.float32(0.03) * 10
    assert rows[0]["latency_ms"] == 4.0


def test_batches_log_one_record_per_row_and_failures_are_contained(tmp_path: Path) -> None:
    async def scenario() -> ShadowRunner:
        fake = FakeChallenger()
        fake.gate.set()
        log = ExperimentLog(str(tmp_path), replica_id="r", flush_interval_s=60)
        runner = ShadowRunner(fake, log, lambda m, v: THRESHOLDS, workers=2)
        runner.start()
        assert runner.submit(job(13))  # raises inside score_fn
        assert runner.submit(job(60, rows=4))  # scores 6.0: DECLINE vs champion APPROVE
        await runner.close(timeout_s=5)
        assert not runner.submit(job(1))  # closed: refused and counted
        log.close()
        return runner

    runner = asyncio.run(scenario())
    assert (runner.completed, runner.failed, runner.dropped) == (1, 1, 1)
    assert runner.decision_flips == 4
    rows = read(tmp_path)
    assert sorted(r["request_id"] for r in rows) == ["r60-0", "r60-1", "r60-2", "r60-3"]
    assert {r["decision"] for r in rows} == {"DECLINE"}


def test_close_gives_up_after_timeout_and_counts_what_was_left(tmp_path: Path) -> None:
    async def scenario() -> ShadowRunner:
        fake = FakeChallenger()  # gate never opens: the challenger hangs
        log = ExperimentLog(str(tmp_path), replica_id="r")
        runner = ShadowRunner(fake, log, lambda m, v: THRESHOLDS)
        runner.start()
        for i in range(3):
            runner.submit(job(i))
        await runner.close(timeout_s=0.05)
        log.close()
        return runner

    runner = asyncio.run(scenario())
    assert runner.completed == 0 and runner.dropped == 2 and runner.queued == 0
