"""Engine faults through a live server: a failing, NaN-returning or hung engine is taken out of
service, its traffic goes to the fallback, and the server stays SERVING."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from fakes import expected_score, primary_and_fallback
from grpc_health.v1 import health_pb2, health_pb2_grpc
from liveserver import LiveServer
from modelkit import write_sequence_model

from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def seq_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    write_sequence_model(root)
    return root


def request(i: int) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=str(i),
        features={f"x{j}": float((i + j) % 5) - 2.0 for j in range(4)},
        history=[pb.HistoryRow(values=[0.5, 1.0, -1.0])],
    )


def want(i: int) -> float:
    r = request(i)
    return float(expected_score(np.array([[r.features[f"x{j}"] for j in range(4)]]))[0])


def serve(seq_models, **settings):
    factory, made = primary_and_fallback()
    server = LiveServer(
        engine_factory=factory,
        models_dir=seq_models,
        default_model="seq-mini",
        budget_ms=5000,
        warmup_iterations=0,
        **settings,
    )
    return server, made


def engine_health(channel) -> dict[str, bool]:
    info = pb_grpc.RiskScoringStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=5)
    return {e.name: e.healthy for e in info.engines}


def overall_health(channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


@pytest.mark.parametrize("fault", ["fail", "nan"])
def test_faulty_engine_falls_back_then_leaves_the_pool(seq_models, fault):
    server, made = serve(seq_models)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        primary, _ = made["seq-mini"]
        primary.batches.clear()  # the load's probe of the output layout
        assert stub.Score(request(0), timeout=5).engine == "primary"
        setattr(primary, fault, True)
        replies = [stub.Score(request(i), timeout=5) for i in range(1, 9)]
        # Every request is answered, by the fallback, with the right score.
        assert {r.engine for r in replies} == {"fallback"}
        assert all(r.score == pytest.approx(want(int(r.request_id)), abs=1e-6) for r in replies)
        reasons = [r.fallback_reason for r in replies]
        assert reasons[:3] == ["engine_error: primary"] * 3
        assert set(reasons[3:]) == {"engines_unavailable"}  # out of the pool
        assert len(primary.batches) == 1 + 3  # no more calls after the third error in a row
        assert engine_health(channel) == {"primary": False, "fallback": True}
        assert overall_health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_hung_engine_is_abandoned_after_the_time_limit(seq_models):
    server, made = serve(seq_models, engine_timeout_ms=100)
    release = threading.Event()
    try:
        with server, server.channel() as channel:
            stub = pb_grpc.RiskScoringStub(channel)
            primary, _ = made["seq-mini"]
            primary.batches.clear()  # the load's probe of the output layout
            assert stub.Score(request(0), timeout=5).engine == "primary"
            primary.hang = release
            first = stub.Score(request(1), timeout=5)
            assert first.engine == "fallback" and first.fallback_reason == "engine_hung: primary"
            assert first.score == pytest.approx(want(1), abs=1e-6)
            # Taken out at once: the next requests go straight to the fallback (not to the
            # hung engine, to be abandoned again).
            later = [stub.Score(request(i), timeout=5) for i in range(2, 12)]
            assert {r.engine for r in later} == {"fallback"}
            assert {r.fallback_reason for r in later} == {"engines_unavailable"}
            assert len(primary.batches) == 2
            assert engine_health(channel) == {"primary": False, "fallback": True}
            assert overall_health(channel) == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()


def test_fallback_failure_is_still_an_error(seq_models):
    """With the primary out and the fallback failing too, callers get INTERNAL, not a score."""
    server, made = serve(seq_models)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        primary, fallback = made["seq-mini"]
        primary.fail = fallback.fail = True
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(request(1), timeout=5)
        assert err.value.code() == grpc.StatusCode.INTERNAL
