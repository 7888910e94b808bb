"""A batch the event loop would start with one unary request waits, turn by turn, for company."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import service.batching.batcher as batcher_module
from service.batching.batcher import ARRIVES_ALONE, MicroBatcher, Scored
from service.batching.rows import RowBatch

GATHER_TURNS = 8


def _batcher(batches: list[int], gather_turns: int = GATHER_TURNS, **kwargs) -> MicroBatcher:
    def run(rows: RowBatch) -> Scored:
        batches.append(rows.rows)
        return Scored(np.zeros(rows.rows, np.float32), "fake", "", 0.0001)

    return MicroBatcher(
        run,
        max_batch_rows=16,
        max_queue_rows=64,
        workers=1,
        gather_turns=gather_turns,
        gather_max_s=kwargs.pop("gather_max_s", 10.0),
        **kwargs,
    )


def _row() -> RowBatch:
    return RowBatch(np.zeros((1, 4), np.float32), None, None)


async def _turns_until_done(task: asyncio.Task[Scored], limit: int = 500) -> int:
    for turn in range(limit):
        if task.done():
            return turn
        await asyncio.sleep(0)  # one turn of the loop
    raise AssertionError(f"not scored within {limit} turns")


async def _arriving_turn_by_turn(batcher: MicroBatcher, count: int, gap_turns: int) -> None:
    """`count` requests, each submitted `gap_turns` turns after the one before."""
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(batcher.submit(_row(), time.monotonic() + 3600)))
        for _ in range(gap_turns):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)


@pytest.fixture
def probe_every_batch(monkeypatch):
    """Every batch started alone gathers, as under load, whatever the gathers before found."""
    monkeypatch.setattr(batcher_module, "_GATHER_PROBE_EVERY", 1)


@pytest.mark.usefixtures("probe_every_batch")
def test_requests_arriving_turns_apart_share_one_batch():
    async def batches_of(gather_turns: int) -> list[int]:
        batches: list[int] = []
        batcher = _batcher(batches, gather_turns)
        batcher.start()
        await _arriving_turn_by_turn(batcher, 4, gap_turns=3)
        await batcher.close(1.0)
        return batches

    assert asyncio.run(batches_of(GATHER_TURNS)) == [4]
    # Without the wait each request is a batch of its own.
    assert asyncio.run(batches_of(0)) == [1, 1, 1, 1]


def test_a_gather_that_brings_no_company_stops_the_next_ones(monkeypatch):
    async def turns() -> tuple[int, int]:
        batcher = _batcher([])
        batcher.start()
        probe = asyncio.create_task(batcher.submit(_row(), time.monotonic() + 3600))
        probe_turns = await _turns_until_done(probe)
        # No probe for a long while: the next lone request runs as on an idle engine.
        monkeypatch.setattr(batcher_module, "_GATHER_PROBE_EVERY", 1000)
        lone = asyncio.create_task(batcher.submit(_row(), time.monotonic() + 3600))
        lone_turns = await _turns_until_done(lone)
        await batcher.close(1.0)
        return probe_turns, lone_turns

    monkeypatch.setattr(batcher_module, "_GATHER_PROBE_EVERY", 1)
    probe_turns, lone_turns = asyncio.run(turns())
    assert probe_turns > GATHER_TURNS  # it waited its idle turns, in vain
    assert lone_turns < GATHER_TURNS


def _turns_for_one(deadline_s: float, streamed: bool = False, **kwargs) -> int:
    """Turns of the loop one request alone takes to be scored."""

    async def turns() -> int:
        batcher = _batcher([], **kwargs)
        batcher.start()

        async def submitted() -> Scored:
            if streamed:
                ARRIVES_ALONE.set(False)  # as a stream's reader sets it for its messages
            return await batcher.submit(_row(), time.monotonic() + deadline_s)

        taken = await _turns_until_done(asyncio.create_task(submitted()))
        await batcher.close(1.0)
        return taken

    return asyncio.run(turns())


@pytest.mark.usefixtures("probe_every_batch")
def test_stream_messages_never_wait_for_company():
    assert _turns_for_one(3600, streamed=True) < GATHER_TURNS
    assert _turns_for_one(3600, streamed=False) > GATHER_TURNS


@pytest.mark.usefixtures("probe_every_batch")
def test_a_request_near_its_deadline_does_not_wait():
    # The longest wait (an hour) would leave no room before the deadline (a minute).
    assert _turns_for_one(60, gather_max_s=3600.0) < GATHER_TURNS


@pytest.mark.usefixtures("probe_every_batch")
def test_a_gather_ends_after_its_longest_wait():
    async def batches_of() -> list[int]:
        batches: list[int] = []
        # No time to wait at all: requests turns apart are batches of their own again.
        batcher = _batcher(batches, gather_max_s=0.0)
        batcher.start()
        await _arriving_turn_by_turn(batcher, 3, gap_turns=3)
        await batcher.close(1.0)
        return batches

    assert asyncio.run(batches_of()) == [1, 1, 1]
