"""The batcher's engine-time model: odd runs move its estimates, never past what admits every
request of the default budget when the engine is back to its usual pace. A batcher that
refuses every request by its estimate runs no batch to learn the estimate was wrong."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from waiting import until

from service.batching.batcher import EngineTimeModel, MicroBatcher, Scored
from service.batching.budget import Budget
from service.batching.rows import RowBatch


def test_one_odd_size_among_runs_of_one_size_leaves_the_estimate_at_the_mean():
    model = EngineTimeModel()
    for _ in range(500):
        model.observe(16.0, 0.001)
    model.observe(17.0, 0.003)  # one run of another size, slower
    assert model.estimate_s(16.0) == pytest.approx(0.001, rel=0.1)
    assert 0.0 < model.estimate_s(1.0) < model.estimate_s(16.0) < model.estimate_s(64.0)


def test_a_batcher_admits_again_after_one_run_that_hung():
    """One engine call that ran for a second (the watchdog's limit) among 1 ms ones: requests
    with a 10 ms budget are still admitted afterwards, and answered."""
    slow = {"s": 0.0}

    def run(rows: RowBatch) -> Scored:
        started = time.perf_counter()
        time.sleep(0.001 + slow["s"])
        return Scored(np.zeros(rows.rows, np.float32), "e", "", time.perf_counter() - started)

    async def scenario() -> int:
        batcher = MicroBatcher(
            run, max_batch_rows=16, max_queue_rows=64, workers=1, inline_max_s=0.0
        )
        batcher.start()
        budget = Budget(0.010)

        def row() -> RowBatch:
            return RowBatch(np.zeros((1, 4), np.float32), None, None)

        for _ in range(100):
            await batcher.submit(row(), budget.deadline(None))
        slow["s"] = 1.0
        await batcher.submit(row(), budget.deadline(5.0))  # a caller with 5 s to spare
        slow["s"] = 0.0
        answered = 0
        for _ in range(50):
            await batcher.submit(row(), budget.deadline(None))  # raises where refused
            answered += 1
        await batcher.close(1.0)
        return answered

    assert asyncio.run(scenario()) == 50


def test_the_queue_ahead_of_a_request_is_costed_at_its_own_history_lengths():
    """60 one-row requests of a one-row history queued: about 7 ms of engine time by the model.
    A request with a 200-row history and 0.2 s of room is admitted; priced at its length, the
    queue ahead came to 1.2 s and it was refused."""
    a, b = 0.001, 0.0001  # engine seconds = a + b * cells, as the model below was taught
    model = EngineTimeModel()
    for _ in range(20):
        for cells in (1, 10, 100, 1000):
            model.observe(cells, a + b * cells)
    gate, busy = threading.Event(), threading.Event()

    def run(rows: RowBatch) -> Scored:
        busy.set()
        gate.wait(30)
        cells = rows.rows * max(rows.history_length, 1)
        return Scored(np.zeros(rows.rows, np.float32), "e", "", a + b * cells)

    def row(length: int) -> RowBatch:
        history = np.zeros((1, length, 3), np.float32)
        return RowBatch(np.zeros((1, 4), np.float32), history, np.ones((1, length), np.float32))

    async def scenario() -> Scored:
        batcher = MicroBatcher(
            run, max_batch_rows=64, max_queue_rows=1000, workers=1, inline_max_s=0.0,
            time_model=model,
        )  # fmt: skip
        batcher.start()
        far = time.monotonic() + 60
        first = asyncio.create_task(batcher.submit(row(1), far))  # holds the engine
        await until(busy.is_set)
        queued = [asyncio.create_task(batcher.submit(row(1), far)) for _ in range(60)]
        await until(lambda: batcher.queued_rows == 60)
        long = asyncio.create_task(batcher.submit(row(200), time.monotonic() + 0.2))
        await until(lambda: batcher.queued_rows == 61 or long.done())
        gate.set()
        await asyncio.gather(first, *queued)
        scored = await long  # raises DeadlineMissed where it was refused
        await batcher.close(1.0)
        return scored

    assert len(asyncio.run(scenario()).scores) == 1


def test_a_request_due_before_the_queue_is_not_made_to_wait_for_it():
    """The queue is taken earliest deadline first: 60 queued rows due in a minute are no work
    ahead of a request due in 5 ms, which is queued, where it was refused."""
    a, b = 0.001, 0.0001
    model = EngineTimeModel()
    for _ in range(20):
        for cells in (1, 10, 100, 1000):
            model.observe(cells, a + b * cells)
    gate, busy = threading.Event(), threading.Event()

    def run(rows: RowBatch) -> Scored:
        busy.set()
        gate.wait(30)
        return Scored(np.zeros(rows.rows, np.float32), "e", "", a + b * rows.rows)

    def row() -> RowBatch:
        return RowBatch(np.zeros((1, 4), np.float32), None, None)

    async def scenario() -> int:
        batcher = MicroBatcher(
            run, max_batch_rows=64, max_queue_rows=1000, workers=1, inline_max_s=0.0,
            time_model=model,
        )  # fmt: skip
        batcher.start()
        far = time.monotonic() + 60
        first = asyncio.create_task(batcher.submit(row(), far))  # holds the engine
        await until(busy.is_set)
        queued = [asyncio.create_task(batcher.submit(row(), far)) for _ in range(60)]
        await until(lambda: batcher.queued_rows == 60)
        urgent = asyncio.create_task(batcher.submit(row(), time.monotonic() + 0.005))
        await until(lambda: batcher.queued_rows == 61 or urgent.done())
        admitted = batcher.queued_rows
        gate.set()
        await asyncio.gather(first, *queued, urgent, return_exceptions=True)
        await batcher.close(1.0)
        return admitted

    assert asyncio.run(scenario()) == 61
