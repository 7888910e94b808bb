"""The client's adaptive throttling: exact on a clock of the test's, and live against a server
that refuses what it cannot take."""

from __future__ import annotations

import asyncio
import random
import socket

import grpc
import pytest
from liveserver import LiveServer
from modelkit import sequence_request, write_sequence_model

from riskclient import AdaptiveThrottle, AsyncRiskClient, RiskClient, ScoringError

OK, REFUSED = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_calls_pass_while_the_server_accepts_and_are_refused_as_it_refuses():
    clock = Clock()
    throttle = AdaptiveThrottle(k=2, window_s=120, clock=clock, draw=lambda: 0.25)
    for _ in range(50):
        assert throttle.allow()
        throttle.record(OK)
    assert throttle.allow()
    throttle.record(grpc.StatusCode.INVALID_ARGUMENT)  # answered: an accept all the same
    assert throttle.counts() == (51, 51) and throttle.rejection_probability() == 0
    for _ in range(100):  # refused: the probability climbs past the draw
        if throttle.allow():
            throttle.record(REFUSED)
    requests, accepts = throttle.counts()
    assert (requests, accepts) == (151, 51)
    assert throttle.rejection_probability() == pytest.approx((151 - 102) / 152)
    assert throttle.throttled > 0
    assert "the server accepted 51 of the last 151 calls" in throttle.refusal()


def test_a_few_failures_are_not_an_overload():
    throttle = AdaptiveThrottle(clock=Clock(), draw=lambda: 0.0)
    for _ in range(throttle.min_requests - 1):  # the calls in flight when a server restarted
        assert throttle.allow()
        throttle.record(grpc.StatusCode.UNAVAILABLE)
    assert throttle.rejection_probability() == 0 and throttle.allow()
    throttle.record(grpc.StatusCode.UNAVAILABLE)
    assert throttle.rejection_probability() > 0 and not throttle.allow()


def test_calls_in_flight_are_not_counted_until_they_end():
    throttle = AdaptiveThrottle(clock=Clock(), draw=lambda: 0.0)
    assert all(throttle.allow() for _ in range(100))  # a burst on a healthy server
    assert throttle.counts() == (0, 0)


def test_the_window_forgets_and_a_recovered_server_is_seen():
    clock = Clock()
    throttle = AdaptiveThrottle(k=2, window_s=10, clock=clock, draw=lambda: 0.0)
    for _ in range(20):
        throttle.allow()
        throttle.record(grpc.StatusCode.UNAVAILABLE)
    assert not throttle.allow()  # p > 0 and the draw is 0: refused
    clock.now += 10  # the refusals leave the window
    assert throttle.counts() == (0, 0) and throttle.allow()
    throttle.record(OK)
    assert throttle.rejection_probability() == 0


LATE = grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.fixture()
def live(tmp_path):
    models = tmp_path / "models"
    write_sequence_model(models)
    with LiveServer(models_dir=models, default_model="seq-mini") as server:
        yield server


def _outcome(exc: ScoringError) -> str:
    if exc.code == REFUSED and exc.message.startswith("throttled by the client"):
        return "throttled"
    assert exc.code == LATE, exc  # 1 µs is never enough: every message sent ends late
    return "late"


def test_a_client_whose_server_does_not_answer_throttles_itself():
    with socket.socket() as probe:  # a port nothing listens on: every call UNAVAILABLE
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
    throttle = AdaptiveThrottle(draw=random.Random(1).random)
    kinds: list[str] = []
    with RiskClient(target, throttle=throttle) as client:
        for i in range(200):
            with pytest.raises(ScoringError) as refused:
                client.score(sequence_request(i, 50), timeout_s=5)
            exc = refused.value
            if exc.code == REFUSED:
                assert exc.message.startswith("throttled by the client"), exc
                kinds.append("throttled")
            else:
                assert exc.code == grpc.StatusCode.UNAVAILABLE, exc
                kinds.append("unavailable")
    assert kinds.count("throttled") == throttle.throttled > 100  # most never left the client
    assert throttle.counts() == (200, 0)


def test_a_stream_refuses_nothing_itself_and_tells_the_throttle_its_failures(live):
    """Each message reaches the server with a budget of 1 µs, which it answers as late. The
    stream sends every one (its window is its throttle), and the throttle it tells then
    refuses the client's unary calls."""
    throttle = AdaptiveThrottle(draw=lambda: 0.0)
    kinds: list[str] = []

    async def scenario() -> None:
        client = AsyncRiskClient(live.target, throttle=throttle)
        async with client, client.stream() as stream:
            for i in range(50):
                request = sequence_request(i, 50)
                request.timeout_us = 1
                try:
                    await stream.score(request, timeout_s=5)
                except ScoringError as exc:
                    kinds.append(_outcome(exc))
            try:
                await client.score(sequence_request(99, 50), timeout_s=5)
            except ScoringError as exc:
                kinds.append(_outcome(exc))

    asyncio.run(scenario())
    assert kinds == ["late"] * 50 + ["throttled"]
    assert throttle.counts() == (51, 0) and throttle.throttled == 1


def test_requests_that_never_left_the_stream_client_are_not_counted():
    """No server to open the stream on: each request waits in the client until its timeout
    and fails there, unsent, and the throttle, which judges the server, never hears of it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
    throttle = AdaptiveThrottle(draw=lambda: 0.0)
    errors: list[ScoringError] = []

    async def scenario() -> None:
        client = AsyncRiskClient(target, throttle=throttle)
        async with client:
            stream = client.stream()
            for i in range(30):
                try:
                    await stream.score(sequence_request(i, 50), timeout_s=0.01)
                except ScoringError as exc:
                    errors.append(exc)
            assert stream.in_flight == 0
            await asyncio.wait_for(stream.close(), timeout=10)  # no wait for a server to come

    asyncio.run(scenario())
    assert [e.code for e in errors] == [LATE] * 30
    assert throttle.counts() == (0, 0) and throttle.throttled == 0
