"""Profile routing, splitting and fallback end to end, with an engine that declares profiles.

The primary FakeEngine accepts at most 8 rows and 16 history rows, and raises ShapeMismatch
outside that as a TensorRT engine does; ONNX-Runtime-like fallback takes the rest.
"""

from __future__ import annotations

import pytest
from fakes import expected_score, primary_and_fallback
from liveserver import LiveServer
from modelkit import write_sequence_model

from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc


def request(i: int, rows: int) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=f"p{i}",
        features={f"x{j}": float(i + j) / 10 for j in range(4)},
        history=[pb.HistoryRow(values=[0.1, 0.2, 0.3])] * rows,
    )


def want(req: pb.ScoreRequest) -> float:
    import numpy as np

    row = np.array([[req.features[f"x{j}"] for j in range(4)]], np.float32)
    return float(expected_score(row)[0])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("profiles")
    write_sequence_model(root, max_length=64)
    factory, made = primary_and_fallback(max_rows=8, max_history=16)
    with LiveServer(
        engine_factory=factory,
        models_dir=root,
        default_model="seq-mini",
        budget_ms=5000,
        warmup_iterations=0,
        engine_timeout_ms=0,
    ) as live:
        yield live, made["seq-mini"]


def test_fitting_shape_runs_on_the_engine(server):
    live, _ = server
    with live.channel() as channel:
        reply = pb_grpc.RiskScoringStub(channel).Score(request(1, 5), timeout=5)
    assert reply.engine == "primary" and reply.fallback_reason == ""
    assert reply.score == pytest.approx(want(request(1, 5)), abs=1e-6)


def test_long_history_falls_back_and_says_why(server):
    live, _ = server
    with live.channel() as channel:
        reply = pb_grpc.RiskScoringStub(channel).Score(request(2, 40), timeout=5)
    assert reply.engine == "fallback"
    assert reply.fallback_reason.startswith("shape_mismatch")
    assert "history" in reply.fallback_reason
    assert reply.score == pytest.approx(want(request(2, 40)), abs=1e-6)


def test_mixed_batch_is_split_not_failed(server):
    live, (primary, fallback) = server
    lengths = [3, 30, 4, 50, 2]
    items = [request(10 + i, n) for i, n in enumerate(lengths)]
    before = (len(primary.batches), len(fallback.batches))
    with live.channel() as channel:
        reply = pb_grpc.RiskScoringStub(channel).ScoreBatch(
            pb.ScoreBatchRequest(requests=items), timeout=5
        )
    engines = [r.engine for r in reply.responses]
    assert engines == ["primary", "fallback", "primary", "fallback", "primary"]
    assert [bool(r.fallback_reason) for r in reply.responses] == [n > 16 for n in lengths]
    for item, r in zip(items, reply.responses, strict=True):
        assert r.request_id == item.request_id
        assert r.score == pytest.approx(want(item), abs=1e-6)
    assert len(primary.batches) > before[0] and len(fallback.batches) > before[1]


def test_batch_larger_than_the_profile_is_chunked_on_the_engine(server):
    live, _ = server
    items = [request(100 + i, 4) for i in range(20)]  # 20 rows > the profile's 8
    with live.channel() as channel:
        reply = pb_grpc.RiskScoringStub(channel).ScoreBatch(
            pb.ScoreBatchRequest(requests=items), timeout=5
        )
    assert {r.engine for r in reply.responses} == {"primary"}
    for item, r in zip(items, reply.responses, strict=True):
        assert r.score == pytest.approx(want(item), abs=1e-6)
