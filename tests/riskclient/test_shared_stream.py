"""AsyncRiskClient's calls share ScoreStreams once they overlap, up to `shared_streams` of
them; alone they stay unary. With shared_stream=False every call is unary."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from fakes import fake_factory
from liveserver import LiveServer
from modelkit import sequence_request, write_sequence_model

from riskclient import AsyncRiskClient, AsyncScoreStream, ScoringError
from riskscoring.v1 import risk_scoring_pb2 as pb


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    write_sequence_model(models)
    with LiveServer(models_dir=models, default_model="seq-mini", budget_ms=5000) as server:
        yield server


def test_calls_one_at_a_time_are_unary(live):
    async def shared() -> tuple[AsyncScoreStream, ...]:
        async with AsyncRiskClient(live.target) as client:
            for i in range(5):
                assert (await client.score(sequence_request(i, 3))).request_id == f"q{i}"
            return client.shared

    assert asyncio.run(shared()) == ()


def _answered(client: AsyncRiskClient) -> int:
    return sum(stream.answered for stream in client.shared)


def test_concurrent_calls_share_the_streams_and_keep_them(live):
    async def run() -> tuple[list[str], int, int, int, bool]:
        async with AsyncRiskClient(live.target) as client:
            await client.score(sequence_request(100, 3))  # alone, unary: connects the channel
            replies = await asyncio.gather(
                *(client.score(sequence_request(i, 3)) for i in range(32))
            )
            streams = client.shared
            after_burst = _answered(client)
            await client.score(sequence_request(99, 3))  # alone now, still on a stream
            after_one = _answered(client)
            drained = all(stream.in_flight == 0 for stream in streams)
        return [r.request_id for r in replies], len(streams), after_burst, after_one, drained

    ids, streams, after_burst, after_one, drained = asyncio.run(run())
    assert ids == [f"q{i}" for i in range(32)]
    # The first call went alone, as a unary call; every later one on a stream, of at most 4.
    assert 1 <= streams <= 4
    assert after_burst == 31
    assert after_one == 32
    assert drained


def test_many_concurrent_calls_spread_over_every_stream(live):
    async def run() -> list[int]:
        async with AsyncRiskClient(live.target, shared_streams=3) as client:
            await client.score(sequence_request(100, 3))  # alone, unary: connects the channel
            first = asyncio.create_task(client.score(sequence_request(0, 3)))  # unary, alone
            await asyncio.sleep(0)
            calls = [client.score(sequence_request(i, 3)) for i in range(1, 64)]
            replies = await asyncio.gather(first, *calls)
            assert [r.request_id for r in replies] == [f"q{i}" for i in range(64)]
            return [stream.answered for stream in client.shared]

    answered = asyncio.run(run())
    # Each call joins the stream with the fewest in flight: 63 calls over 3 streams, 21 each.
    assert answered == [21, 21, 21]


def test_a_request_id_already_on_a_stream_is_sent_unary(live):
    async def run() -> tuple[list[str], int]:
        async with AsyncRiskClient(live.target) as client:
            await client.score(sequence_request(100, 3))  # alone, unary: connects the channel
            same = sequence_request(7, 3)
            replies = await asyncio.gather(*(client.score(same) for _ in range(3)))
            assert client.shared
            return [r.request_id for r in replies], _answered(client)

    ids, streamed = asyncio.run(run())
    # Unary (alone), then a stream, then unary again: the id was in flight on a stream.
    assert ids == ["q7"] * 3
    assert streamed == 1


def test_without_shared_streams_concurrent_calls_are_unary(live):
    async def shared() -> tuple[AsyncScoreStream, ...]:
        async with AsyncRiskClient(live.target, shared_stream=False) as client:
            replies = await asyncio.gather(
                *(client.score(sequence_request(i, 3)) for i in range(16))
            )
            assert [r.request_id for r in replies] == [f"q{i}" for i in range(16)]
            return client.shared

    assert asyncio.run(shared()) == ()


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


def test_a_request_kept_from_a_full_window_fails_in_a_quarter_of_its_timeout(tmp_path):
    """A window of one, taken by a request the server holds 300 ms: the next request waits in
    the client a quarter of its 200 ms timeout, then fails there, never sent, and the first
    is answered."""
    models = tmp_path / "models"
    write_sequence_model(models)
    factory, _ = fake_factory(base_s=0.3)
    server = LiveServer(
        engine_factory=factory, models_dir=models, default_model="seq-mini", budget_ms=5000
    )

    async def run(target: str) -> tuple[object, object, int]:
        async with AsyncRiskClient(target) as client:
            stream = client.stream(max_in_flight=1)
            await stream.score(sequence_request(0, 3), timeout_s=5)  # the stream is open
            held = asyncio.ensure_future(stream.score(sequence_request(1, 3), timeout_s=5))
            while stream.sent_unanswered < 1:
                await asyncio.sleep(0.001)
            kept = await asyncio.gather(
                stream.score(sequence_request(2, 3), timeout_s=0.2), return_exceptions=True
            )
            answered = await held
            await stream.close()
            return kept[0], answered, stream.answered

    with server:
        kept, answered, streamed = asyncio.run(run(server.target))
    assert isinstance(kept, ScoringError) and kept.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert kept.request_id == "q2"
    assert "within 50 ms, a quarter of the timeout" in kept.message
    assert "nothing was sent" in kept.message
    assert isinstance(answered, pb.ScoreResponse) and answered.request_id == "q1"
    assert streamed == 2  # q0 and q1: q2 never reached the server


def test_with_the_server_down_overlapping_calls_are_unary_and_fail_fast():
    """Nothing listens: the channel never has a connection up, so no stream is opened (one
    would wait for a server until each call's timeout) and every call is a unary call that
    fails UNAVAILABLE, or is throttled once enough have."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"

    async def run() -> tuple[list[str], tuple[AsyncScoreStream, ...]]:
        async with AsyncRiskClient(target, timeout_s=30) as client:
            outcomes = await asyncio.gather(
                *(client.score(sequence_request(i, 3)) for i in range(40)),
                return_exceptions=True,
            )
            return [o.code.name for o in outcomes if isinstance(o, ScoringError)], client.shared

    codes, shared = asyncio.run(run())
    assert len(codes) == 40 and set(codes) <= {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}
    assert "UNAVAILABLE" in codes
    assert shared == ()


def test_requests_that_time_out_unsent_are_not_kept_while_nothing_can_be_sent():
    """A stream waiting for a server that is down sends nothing: each request it is given times
    out unsent, and none of them is held after (each held its request until a send passed it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"

    async def run() -> tuple[list[str], int]:
        async with grpc.aio.insecure_channel(target) as channel:
            stream = AsyncScoreStream(channel, timeout_s=0.002)
            codes = []
            for i in range(1_000):
                with pytest.raises(ScoringError) as failed:
                    await stream.score(sequence_request(i, 3))
                codes.append(failed.value.code.name)
            held = len(stream._outbox)
            await stream.close(0)
            return codes, held

    codes, held = asyncio.run(run())
    assert set(codes) <= {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
    assert held <= 65  # at most the sweep's slack and the last one, none of them live
