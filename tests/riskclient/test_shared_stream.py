"""With shared_stream=True, AsyncRiskClient's calls share one ScoreStream once they overlap;
alone they stay unary. By default every call is unary."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from liveserver import LiveServer
from modelkit import sequence_request, write_sequence_model

from riskclient import AsyncRiskClient, AsyncScoreStream


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    write_sequence_model(models)
    with LiveServer(models_dir=models, default_model="seq-mini", budget_ms=5000) as server:
        yield server


def test_calls_one_at_a_time_are_unary(live):
    async def shared() -> object:
        async with AsyncRiskClient(live.target, shared_stream=True) as client:
            for i in range(5):
                assert (await client.score(sequence_request(i, 3))).request_id == f"q{i}"
            return client.shared

    assert asyncio.run(shared()) is None


def test_concurrent_calls_share_one_stream_and_keep_it(live):
    async def run() -> tuple[list[str], int, int, bool]:
        async with AsyncRiskClient(live.target, shared_stream=True) as client:
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
        async with AsyncRiskClient(live.target, shared_stream=True) as client:
            same = sequence_request(7, 3)
            replies = await asyncio.gather(*(client.score(same) for _ in range(3)))
            assert client.shared is not None
            return [r.request_id for r in replies], client.shared.answered

    ids, streamed = asyncio.run(run())
    # Unary (alone), then the stream, then unary again: the id was in flight on the stream.
    assert ids == ["q7"] * 3
    assert streamed == 1


def test_by_default_concurrent_calls_are_unary(live):
    async def shared() -> object:
        async with AsyncRiskClient(live.target) as client:
            replies = await asyncio.gather(
                *(client.score(sequence_request(i, 3)) for i in range(16))
            )
            assert [r.request_id for r in replies] == [f"q{i}" for i in range(16)]
            return client.shared

    assert asyncio.run(shared()) is None


def test_a_stream_carries_at_most_its_window_unanswered(live):
    async def run() -> tuple[int, list[str]]:
        most = 0
        async with AsyncRiskClient(live.target) as client:
            stream = client.stream(max_in_flight=2)
            calls = asyncio.gather(*(stream.score(sequence_request(i, 3)) for i in range(20)))
            while not calls.done():
                most = max(most, stream.sent_unanswered)
                await asyncio.sleep(0)
            replies = await calls
            await stream.close()
        return most, [r.request_id for r in replies]

    most, ids = asyncio.run(run())
    assert ids == [f"q{i}" for i in range(20)]
    assert 1 <= most <= 2  # the window starts above 2: the cap holds it


def test_the_window_halves_on_late_answers_and_grows_on_prompt_ones():
    async def windows() -> list[int]:
        async with grpc.aio.insecure_channel("127.0.0.1:9") as channel:
            stream = AsyncScoreStream(channel, max_in_flight=32)
            seen = [stream.window]
            for _ in range(8):  # a window's worth of late answers: halved once
                stream._adapt(late=True)
            seen.append(stream.window)
            for _ in range(3):  # fewer than a window's worth since: not again
                stream._adapt(late=True)
            seen.append(stream.window)
            stream._adapt(late=True)  # a window's worth (4) since the cut: halved
            seen.append(stream.window)
            for _ in range(100):  # prompt answers: one more a window's worth
                stream._adapt(late=False)
            seen.append(stream.window)
            for _ in range(10_000):
                stream._adapt(late=False)
            seen.append(stream.window)
        return seen

    first, halved, held, again, grown, capped = asyncio.run(windows())
    assert (first, halved, held, again) == (8, 4, 4, 2)
    assert 2 < grown < 32
    assert capped == 32
