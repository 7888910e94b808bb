"""A batch the event loop would start with one unary request waits a moment for company."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from liveserver import LiveServer
from modelkit import write_sequence_model

import service.batching.batcher as batcher_module
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.batching.batcher import ARRIVES_ALONE, MicroBatcher, Scored
from service.batching.rows import RowBatch

# Long enough that a request waiting for company is still waiting after any number of turns
# of the loop a test takes; each test that lets a wait run out chooses a short one.
WAIT_S = 3600.0
# Turns of the loop a request on an idle engine takes at most to be scored.
PROMPT_TURNS = 10


def _batcher(batches: list[int], gather_s: float = WAIT_S, **kwargs) -> MicroBatcher:
    def run(rows: RowBatch) -> Scored:
        batches.append(rows.rows)
        return Scored(np.zeros(rows.rows, np.float32), "fake", "", 0.0001)

    return MicroBatcher(
        run, max_batch_rows=4, max_queue_rows=64, workers=1, gather_s=gather_s, **kwargs
    )


def _row() -> RowBatch:
    return RowBatch(np.zeros((1, 4), np.float32), None, None)


async def _done_within(task: asyncio.Future[Scored], turns: int) -> bool:
    for _ in range(turns):
        if task.done():
            return True
        await asyncio.sleep(0)  # one turn of the loop: no time passes for a timer
    return task.done()


def _submit(batcher: MicroBatcher, streamed: bool = False) -> asyncio.Task[Scored]:
    async def submitted() -> Scored:
        if streamed:
            ARRIVES_ALONE.set(False)  # as a stream's reader sets it for its messages
        return await batcher.submit(_row(), time.monotonic() + 2 * WAIT_S)

    return asyncio.create_task(submitted())


@pytest.fixture
def probe_every_batch(monkeypatch):
    """Every batch started alone waits, as under load, whatever the waits before found."""
    monkeypatch.setattr(batcher_module, "_GATHER_PROBE_EVERY", 1)


@pytest.mark.usefixtures("probe_every_batch")
def test_requests_arriving_turns_apart_share_one_batch():
    async def batches_of(gather_s: float) -> list[int]:
        batches: list[int] = []
        batcher = _batcher(batches, gather_s)
        batcher.start()
        tasks = []
        for _ in range(3):
            tasks.append(_submit(batcher))
            for _ in range(3):
                await asyncio.sleep(0)
        await asyncio.gather(*tasks, *[_submit(batcher)])  # the fourth fills the batch
        await batcher.close(1.0)
        return batches

    # The first request waits; the others join it, and the full batch starts at once.
    assert asyncio.run(batches_of(WAIT_S)) == [4]
    # Without the wait each request is a batch of its own.
    assert asyncio.run(batches_of(0.0)) == [1, 1, 1, 1]


def test_a_wait_that_brings_no_company_is_not_repeated(monkeypatch):
    async def waits() -> tuple[bool, bool]:
        batcher = _batcher([], gather_s=0.02)
        batcher.start()
        probe = _submit(batcher)
        probe_waited = not await _done_within(probe, PROMPT_TURNS)
        await probe  # alone for its whole wait
        # No probe for a long while: the next lone request runs as on an idle engine.
        monkeypatch.setattr(batcher_module, "_GATHER_PROBE_EVERY", 1000)
        lone_prompt = await _done_within(_submit(batcher), PROMPT_TURNS)
        await batcher.close(1.0)
        return probe_waited, lone_prompt

    monkeypatch.setattr(batcher_module, "_GATHER_PROBE_EVERY", 1)
    assert asyncio.run(waits()) == (True, True)


def _prompt(streamed: bool = False, deadline_s: float = 2 * WAIT_S) -> bool:
    """Whether one request alone is scored within a few turns of the loop (closing the
    batcher then starts a batch still waiting)."""

    async def prompt() -> bool:
        batcher = _batcher([])
        batcher.start()
        if deadline_s < 2 * WAIT_S:
            task = asyncio.create_task(batcher.submit(_row(), time.monotonic() + deadline_s))
        else:
            task = _submit(batcher, streamed)
        scored = await _done_within(task, PROMPT_TURNS)
        await batcher.close(1.0)
        assert (await task).engine == "fake"
        return scored

    return asyncio.run(prompt())


@pytest.mark.usefixtures("probe_every_batch")
def test_stream_messages_never_wait_for_company():
    assert _prompt(streamed=True)
    assert not _prompt(streamed=False)


@pytest.mark.usefixtures("probe_every_batch")
def test_a_request_whose_deadline_leaves_no_room_does_not_wait():
    # The wait (an hour) would leave no room before the deadline (a minute).
    assert _prompt(deadline_s=60.0)


@pytest.mark.usefixtures("probe_every_batch")
def test_a_request_come_during_a_wait_with_no_room_for_its_rest_ends_it():
    async def scenario() -> bool:
        batches: list[int] = []
        batcher = _batcher(batches)
        batcher.start()
        waiting = _submit(batcher)
        assert not await _done_within(waiting, PROMPT_TURNS)  # it waits for company
        hasty = asyncio.create_task(batcher.submit(_row(), time.monotonic() + 60.0))
        ended = await _done_within(hasty, PROMPT_TURNS) and waiting.done()
        await batcher.close(1.0)
        return ended and batches == [2]

    assert asyncio.run(scenario())


def test_light_load_never_waits():
    # Before any wait has brought company, a lone request on an idle engine runs at once.
    assert _prompt()


@pytest.mark.usefixtures("probe_every_batch")
def test_a_wait_ends_once_the_company_the_last_one_found_has_come():
    """Closed-loop callers send nothing more until answered: once as many requests as the last
    wait gathered are queued, the batch starts without waiting out its time."""

    async def second_pair_prompt() -> tuple[list[int], bool]:
        batches: list[int] = []
        batcher = _batcher(batches, gather_s=1.0)
        batcher.start()
        first = _submit(batcher)
        for _ in range(3):
            await asyncio.sleep(0)
        await asyncio.gather(first, _submit(batcher))  # waits out its second: 2 rows came
        third = _submit(batcher)
        for _ in range(3):
            await asyncio.sleep(0)
        fourth = _submit(batcher)
        prompt = await _done_within(asyncio.gather(third, fourth), PROMPT_TURNS)
        await batcher.close(1.0)
        return batches, prompt

    assert asyncio.run(second_pair_prompt()) == ([2, 2], True)


def test_stream_messages_on_a_live_server_never_wait(tmp_path, monkeypatch):
    """A server whose unary requests would wait half a minute for company answers a stream's
    messages without a wait: the stream's reader marks them as arriving many at a time."""
    monkeypatch.setattr(batcher_module, "_GATHER_PROBE_EVERY", 1)
    write_sequence_model(tmp_path)
    server = LiveServer(
        models_dir=tmp_path, default_model="seq-mini", budget_ms=120_000, gather_us=30_000_000
    )
    messages = [
        pb.ScoreRequest(
            request_id=f"s{i}",
            features={f"x{j}": 0.1 * j for j in range(4)},
            history=[pb.HistoryRow(values=[0.5, 1.0, -1.0])] * 2,
        )
        for i in range(3)
    ]
    with server, server.channel() as channel:
        # The call's 60 s leave each message room for the wait: only the mark prevents it.
        replies = list(pb_grpc.RiskScoringStub(channel).ScoreStream(iter(messages), timeout=60))
        assert server.server is not None
        gather = server.server.registry.get("seq-mini").batcher._gather
    assert sorted(r.request_id for r in replies) == ["s0", "s1", "s2"]
    assert gather.started_at == 0.0  # no wait ever began
