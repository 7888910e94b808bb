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


A_S, B_S = 0.001, 0.0001  # engine seconds = A_S + B_S * cells, as the batcher's model learnt


def _behind_a_queue(queued: RowBatch, new: RowBatch, room_s: float) -> tuple[int, object]:
    """One batch held on the engine, 60 `queued` jobs due in a minute behind it, then `new`
    due in `room_s`: the rows then queued (61 where `new` was admitted) and `new`'s outcome,
    once the engine was let go."""
    model = EngineTimeModel()
    for _ in range(20):
        for cells in (1, 10, 100, 1000):
            model.observe(cells, A_S + B_S * cells)
    gate, busy = threading.Event(), threading.Event()

    def run(rows: RowBatch) -> Scored:
        busy.set()
        gate.wait(30)
        cells = rows.rows * max(rows.history_length, 1)
        return Scored(np.zeros(rows.rows, np.float32), "e", "", A_S + B_S * cells)

    async def scenario() -> tuple[int, object]:
        batcher = MicroBatcher(
            run, max_batch_rows=64, max_queue_rows=1000, workers=1, inline_max_s=0.0,
            time_model=model,
        )  # fmt: skip
        batcher.start()
        far = time.monotonic() + 60
        first = asyncio.create_task(batcher.submit(queued, far))  # holds the engine
        await until(busy.is_set)
        waiting = [asyncio.create_task(batcher.submit(queued, far)) for _ in range(60)]
        await until(lambda: batcher.queued_rows == 60)
        last = asyncio.create_task(batcher.submit(new, time.monotonic() + room_s))
        await until(lambda: batcher.queued_rows == 61 or last.done())
        admitted = batcher.queued_rows
        gate.set()
        outcomes = await asyncio.gather(first, *waiting, last, return_exceptions=True)
        await batcher.close(1.0)
        return admitted, outcomes[-1]

    return asyncio.run(scenario())


def _row(length: int) -> RowBatch:
    history = np.zeros((1, length, 3), np.float32)
    return RowBatch(np.zeros((1, 4), np.float32), history, np.ones((1, length), np.float32))


def test_the_queue_ahead_of_a_request_is_costed_at_its_own_history_lengths():
    """60 one-row requests of a one-row history queued: about 7 ms of engine time by the model.
    A request with a 200-row history and 0.2 s of room is admitted and scored; priced at its
    length, the queue ahead came to 1.2 s and it was refused."""
    admitted, outcome = _behind_a_queue(_row(1), _row(200), 0.2)
    assert admitted == 61 and isinstance(outcome, Scored)


def test_a_request_due_before_the_queue_is_not_made_to_wait_for_it():
    """The queue is taken earliest deadline first: 60 queued rows due in a minute are no work
    ahead of a request due in 5 ms, which is queued, where it was refused."""
    admitted, _ = _behind_a_queue(_row(1), _row(1), 0.005)
    assert admitted == 61
