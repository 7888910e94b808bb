"""The client's adaptive throttling: exact on a clock of the test's, and live against a server
that refuses what it cannot take."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from liveserver import LiveServer
from modelkit import sequence_request, write_sequence_model

from riskclient import AdaptiveThrottle, RiskClient, ScoringError

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
    throttle.record(grpc.StatusCode.INVALID_ARGUMENT)  # answered: an accept all the same
    assert throttle.counts() == (50, 51) and throttle.rejection_probability() == 0
    for _ in range(100):  # refused: the probability climbs past the draw
        if throttle.allow():
            throttle.record(REFUSED)
    requests, accepts = throttle.counts()
    assert (requests, accepts) == (150, 51)
    assert throttle.rejection_probability() == pytest.approx((150 - 102) / 151)
    assert throttle.throttled > 0
    assert "the server accepted 51 of the last 150 calls" in throttle.refusal()


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


def test_a_client_facing_refusals_throttles_itself_and_fails_at_once(tmp_path):
    models = tmp_path / "models"
    write_sequence_model(models)
    settings = dict(
        models_dir=models,
        default_model="seq-mini",
        max_requests_in_progress=1,  # every call beyond one at a time is refused
        engine_inline_max_us=0,  # batches on an engine thread: calls overlap meanwhile
        budget_ms=2000,
    )
    outcomes: list[tuple[str, float]] = []
    with LiveServer(**settings) as live, RiskClient(live.target) as client:

        def call(i: int) -> None:
            started = time.monotonic()
            try:
                client.score(sequence_request(i, 50), timeout_s=5)
                outcomes.append(("ok", 0.0))
            except ScoringError as exc:
                assert exc.code == REFUSED, exc
                local = exc.message.startswith("throttled by the client")
                outcomes.append(("throttled" if local else "refused", time.monotonic() - started))

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(call, range(800)))
    kinds = [kind for kind, _ in outcomes]
    assert kinds.count("refused") > 0 and kinds.count("ok") > 0
    assert kinds.count("throttled") == client.throttle.throttled > 0
    requests, accepts = client.throttle.counts()
    assert requests == 800 and accepts == kinds.count("ok")
