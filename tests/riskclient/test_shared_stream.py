"""AsyncRiskClient's calls share one ScoreStream once they overlap; alone they stay unary."""

from __future__ import annotations

import asyncio

import pytest
from liveserver import LiveServer
from modelkit import sequence_request, write_sequence_model

from riskclient import AsyncRiskClient


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    write_sequence_model(models)
    with LiveServer(models_dir=models, default_model="seq-mini", budget_ms=5000) as server:
        yield server


def test_calls_one_at_a_time_are_unary(live):
    async def shared() -> object:
        async with AsyncRiskClient(live.target) as client:
            for i in range(5):
                assert (await client.score(sequence_request(i, 3))).request_id == f"q{i}"
            return client.shared

    assert asyncio.run(shared()) is None


def test_concurrent_calls_share_one_stream_and_keep_it(live):
    async def run() -> tuple[list[str], int, int, bool]:
        async with AsyncRiskClient(live.target) as client:
            replies = await asyncio.gather(
                *(client.score(sequence_request(i, 3)) for i in range(32))
            )
            stream = client.shared
            assert stream is not None
            after_burst = stream.answered
            await client.score(sequence_request(99, 3))  # alone now, still on the stream
            after_one = stream.answered
        return [r.request_id for r in replies], after_burst, after_one, stream.in_flight == 0

    ids, after_burst, after_one, drained = asyncio.run(run())
    assert ids == [f"q{i}" for i in range(32)]
    # The first call went alone, as a unary call; every later one on the stream.
    assert after_burst == 31
    assert after_one == 32
    assert drained


def test_a_request_id_already_on_the_stream_is_sent_unary(live):
    async def run() -> tuple[list[str], int]:
        async with AsyncRiskClient(live.target) as client:
            same = sequence_request(7, 3)
            replies = await asyncio.gather(*(client.score(same) for _ in range(3)))
            assert client.shared is not None
            return [r.request_id for r in replies], client.shared.answered

    ids, streamed = asyncio.run(run())
    # Unary (alone), then the stream, then unary again: the id was in flight on the stream.
    assert ids == ["q7"] * 3
    assert streamed == 1


def test_the_shared_stream_can_be_turned_off(live):
    async def shared() -> object:
        async with AsyncRiskClient(live.target, shared_stream=False) as client:
            replies = await asyncio.gather(
                *(client.score(sequence_request(i, 3)) for i in range(16))
            )
            assert [r.request_id for r in replies] == [f"q{i}" for i in range(16)]
            return client.shared

    assert asyncio.run(shared()) is None
