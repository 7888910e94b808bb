"""Score, ScoreBatch and GetModelInfo on a live server, against ONNX Runtime run directly."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from liveserver import LiveServer
from modelkit import write_tabular_model

from demo.generator import FEATURE_NAMES, HISTORY_FIELDS, generate
from engines.manifest import load_manifest
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc


def demo_request(data, i: int) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=f"r{i}",
        entity_id=data.entity_ids[i],
        features={n: float(v) for n, v in zip(FEATURE_NAMES, data.features[i], strict=True)},
        history=[pb.HistoryRow(values=row.tolist()) for row in data.histories[i]],
    )


def direct_scores(model_dir: Path, data, rows: list[int]) -> np.ndarray:
    """Each row scored alone by ONNX Runtime with default options, history unpadded."""
    session = ort.InferenceSession(
        str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    out = []
    for i in rows:
        h = data.histories[i]
        length = max(1, h.shape[0])
        history = np.zeros((1, length, len(HISTORY_FIELDS)), np.float32)
        mask = np.zeros((1, length), np.float32)
        history[0, : h.shape[0]] = h
        mask[0, : h.shape[0]] = 1
        feed = {"features": data.features[i : i + 1], "history": history, "history_mask": mask}
        out.append(float(session.run(["score"], feed)[0].reshape(-1)[0]))
    return np.array(out)


@pytest.fixture(scope="module")
def stub(live):
    with live.channel() as channel:
        yield pb_grpc.RiskScoringStub(channel)


@pytest.fixture(scope="module")
def data():
    return generate(64, seed=9001)


def test_score_matches_onnxruntime_and_thresholds(stub, data, models_root):
    manifest = load_manifest(models_root / "fraud-demo" / "1")
    rows = list(range(24))
    expected = direct_scores(models_root / "fraud-demo" / "1", data, rows)
    for i, want in zip(rows, expected, strict=True):
        reply = stub.Score(demo_request(data, i), timeout=5)
        assert reply.request_id == f"r{i}"
        assert reply.model == "fraud-demo" and reply.model_version == "1"
        assert reply.engine == "onnxruntime-cpu" and reply.fallback_reason == ""
        assert abs(reply.score - want) <= 1e-6
        decision = manifest.thresholds.decide(reply.score)
        assert pb.Decision.Name(reply.decision) == decision
        assert reply.timings.total_us >= reply.timings.engine_us > 0


def test_concurrent_scores_each_get_their_own_row(data, models_root):
    """Requests merged into batches still get exactly their own scores back.

    An idle engine takes a lone request at once, so this server waits up to 5 ms for company:
    concurrent requests then share batches whatever the machine's speed.
    """
    rows = list(range(64))
    expected = dict(
        zip(rows, direct_scores(models_root / "fraud-demo" / "1", data, rows), strict=True)
    )
    server = LiveServer(
        models_dir=models_root,
        max_batch_size=32,
        budget_ms=5000,
        onnx_variants=False,
        max_queue_delay_us=5000,
    )
    with server, server.channel() as channel, concurrent.futures.ThreadPoolExecutor(16) as pool:
        stub = pb_grpc.RiskScoringStub(channel)
        replies = list(pool.map(lambda i: stub.Score(demo_request(data, i), timeout=10), rows * 3))
    assert len(replies) == 3 * len(rows)
    for reply in replies:
        i = int(reply.request_id[1:])
        assert abs(reply.score - expected[i]) <= 1e-6
    assert max(r.timings.batch_size for r in replies) > 1


def test_score_batch_keeps_order(stub, data, models_root):
    rows = [5, 1, 9, 30, 2]
    expected = direct_scores(models_root / "fraud-demo" / "1", data, rows)
    reply = stub.ScoreBatch(
        pb.ScoreBatchRequest(model="fraud-demo", requests=[demo_request(data, i) for i in rows]),
        timeout=5,
    )
    assert [r.request_id for r in reply.responses] == [f"r{i}" for i in rows]
    got = np.array([r.score for r in reply.responses])
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert all(r.timings.batch_size >= len(rows) for r in reply.responses)


def test_a_batch_beyond_the_limit_is_refused_before_its_items_are_read(stub, models_root):
    """The count is checked first: a few megabytes of empty items are millions, and reading each
    (here the first asks for reasons, which ScoreBatch refuses) would hold the event loop."""
    limit = load_manifest(models_root / "fraud-demo" / "1").max_batch_size
    items = [pb.ScoreRequest(explain_top_k=1)] + [pb.ScoreRequest()] * limit
    with pytest.raises(grpc.RpcError) as refused:
        stub.ScoreBatch(pb.ScoreBatchRequest(model="fraud-demo", requests=items), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == f"requests: {limit + 1} rows exceed the limit of {limit}"


def test_second_differently_shaped_models_serve(stub):
    tabular = stub.Score(
        pb.ScoreRequest(model="credit-lite", features={f"f{i}": 0.1 * i for i in range(5)}),
        timeout=5,
    )
    assert tabular.model == "credit-lite" and 0 <= tabular.score <= 1
    sequence = stub.Score(
        pb.ScoreRequest(
            model="seq-mini",
            features={f"x{i}": 1.0 for i in range(4)},
            history=[pb.HistoryRow(values=[0.5, -1.0, 2.0])] * 3,
        ),
        timeout=5,
    )
    assert sequence.model == "seq-mini" and 0 <= sequence.score <= 1


def test_model_info_describes_schema(stub, models_root):
    info = stub.GetModelInfo(pb.ModelInfoRequest(model="fraud-demo"), timeout=5)
    manifest = load_manifest(models_root / "fraud-demo" / "1")
    assert tuple(info.feature_names) == FEATURE_NAMES
    assert tuple(info.history_fields) == HISTORY_FIELDS
    assert info.max_history_length == manifest.history.max_length
    assert info.thresholds.review == pytest.approx(manifest.thresholds.review)
    assert info.thresholds.decline == pytest.approx(manifest.thresholds.decline)
    assert [e.name for e in info.engines] == ["onnxruntime-cpu"]
    assert info.engines[0].healthy
    assert list(info.versions) == ["1"]
    tabular = stub.GetModelInfo(pb.ModelInfoRequest(model="credit-lite"), timeout=5)
    assert list(tabular.feature_names) == [f"f{i}" for i in range(5)]
    assert list(tabular.history_fields) == []


def test_health_and_reflection(live):
    with live.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "riskscoring.v1.RiskScoring", "inference.GRPCInferenceService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(
            reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
        )
        names = {s.name for s in answers[0].list_services_response.service}
        assert {
            "riskscoring.v1.RiskScoring",
            "inference.GRPCInferenceService",
            "grpc.health.v1.Health",
        } <= names


def test_unknown_model_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(pb.ScoreRequest(model="nope", features={"a": 1.0}), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in err.value.details()


def test_validated_variants_join_the_pool_fastest_first(models_root):
    """FP16 and INT8 passed validation, so they load; the measured-fastest engine serves."""
    with LiveServer(models_dir=models_root, budget_ms=5000) as server, server.channel() as ch:
        stub = pb_grpc.RiskScoringStub(ch)
        info = stub.GetModelInfo(pb.ModelInfoRequest(model="fraud-demo"), timeout=5)
        names = [e.name for e in info.engines]
        assert set(names) == {"onnxruntime-cpu", "onnxruntime-cpu-fp16", "onnxruntime-cpu-int8"}
        assert {e.precision for e in info.engines} == {"fp32", "fp16", "int8"}
        reply = stub.Score(demo_request(generate(1, seed=3), 0), timeout=5)
        assert reply.engine == names[0]
        assert reply.fallback_reason == ""


def test_reflection_is_off_unless_enabled(tmp_path):
    write_tabular_model(tmp_path)
    with (
        LiveServer(models_dir=tmp_path, default_model="credit-lite") as server,
        server.channel() as channel,
    ):
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(reflect.ServerReflectionInfo(iter([request]), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # The services themselves are there.
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
