"""Random requests against a live server: every answer is OK or a clear status, never INTERNAL
or UNKNOWN; the server stays healthy and its memory does not grow beyond a bound."""

from __future__ import annotations

import math

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from liveserver import LiveServer
from modelkit import write_sequence_model, write_tabular_model

from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

EXAMPLES = 300  # per message type; about 15 s in all on two cores
CLEAR = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
RSS_GROWTH_BYTES = 64 * 1024 * 1024
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
tried = {"inputs": 0}

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1e38, -1e38, 3.4e38, float("nan"), float("inf"), 1e-45]),
)
feature_names = st.one_of(
    st.sampled_from([f"x{i}" for i in range(4)] + [f"f{i}" for i in range(5)]),
    st.text(max_size=12),
)
models = st.sampled_from(["", "seq-mini", "credit-lite", "nope", "seq-mini\x00", "ü" * 40])
versions = st.sampled_from(["", "1", "2", "-1", "1" * 30])
history_rows = st.lists(st.builds(pb.HistoryRow, values=st.lists(floats, max_size=5)), max_size=40)


@st.composite
def score_requests(draw) -> pb.ScoreRequest:
    names = draw(st.lists(feature_names, max_size=8))
    if draw(st.booleans()):  # often a complete, valid feature map
        names += [f"x{i}" for i in range(4)]
    return pb.ScoreRequest(
        request_id=draw(st.text(max_size=20)),
        entity_id=draw(st.text(max_size=20)),
        model=draw(models),
        model_version=draw(versions),
        features={name: draw(floats) for name in names},
        history=draw(history_rows),
    )


@st.composite
def batch_requests(draw) -> pb.ScoreBatchRequest:
    return pb.ScoreBatchRequest(
        model=draw(models),
        model_version=draw(versions),
        requests=draw(st.lists(score_requests(), max_size=6)),
    )


dims = st.one_of(st.integers(-3, 70), st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1]))


@st.composite
def infer_requests(draw) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(
        model_name=draw(models), model_version=draw(versions), id=draw(st.text(max_size=8))
    )
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 4))):
        tensor = request.inputs.add(
            name=draw(st.sampled_from(["features", "history", "history_mask", "x", "", "score"])),
            datatype=draw(st.sampled_from(["FP32", "FP64", "INT64", "BYTES", "fp32", ""])),
            shape=draw(st.lists(dims, max_size=4)),
        )
        if raw:
            request.raw_input_contents.append(draw(st.binary(max_size=512)))
        else:
            tensor.contents.fp32_contents.extend(draw(st.lists(floats, max_size=128)))
    return request


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    write_sequence_model(root)
    write_tabular_model(root)
    with LiveServer(
        models_dir=root, default_model="seq-mini", budget_ms=2000, onnx_variants=False
    ) as live:
        yield live


@pytest.fixture(scope="module")
def channel(server):
    with server.channel() as channel:
        yield channel


@pytest.fixture(scope="module")
def rss_at_start(channel):
    # Warm every path once before taking the baseline.
    pb_grpc.RiskScoringStub(channel).Score(
        pb.ScoreRequest(features={f"x{i}": 0.0 for i in range(4)}), timeout=5
    )
    return psutil.Process().memory_info().rss


def check(call, request) -> None:
    tried["inputs"] += 1
    try:
        call(request, timeout=5)
    except grpc.RpcError as exc:
        assert exc.code() in CLEAR, (exc.code(), exc.details(), request)
        assert "Traceback" not in (exc.details() or "")


@FUZZ
@given(request=score_requests())
def test_score(channel, rss_at_start, request):
    check(pb_grpc.RiskScoringStub(channel).Score, request)


@FUZZ
@given(request=batch_requests())
def test_score_batch(channel, rss_at_start, request):
    check(pb_grpc.RiskScoringStub(channel).ScoreBatch, request)


def _overflowing_shape() -> oip.ModelInferRequest:
    # 2**32 * 2**32 wraps to 0 in int64: it must not pass as an empty tensor.
    request = oip.ModelInferRequest(model_name="credit-lite")
    request.inputs.add(name="x", datatype="FP32", shape=[2**32, 2**32])
    return request


@FUZZ
@given(request=infer_requests())
@example(request=_overflowing_shape())
def test_model_infer(channel, rss_at_start, request):
    check(oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer, request)


@FUZZ
@given(data=st.binary(max_size=256))
def test_undecodable_bytes(channel, rss_at_start, data):
    for method in (
        "/riskscoring.v1.RiskScoring/Score",
        "/inference.GRPCInferenceService/ModelInfer",
    ):
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        check(call, data)


def test_server_is_healthy_and_memory_bounded(channel, rss_at_start):
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    valid = pb.ScoreRequest(features={f"x{i}": 0.5 for i in range(4)})
    assert math.isfinite(pb_grpc.RiskScoringStub(channel).Score(valid, timeout=5).score)
    growth = psutil.Process().memory_info().rss - rss_at_start
    print(f"fuzz: {tried['inputs']} inputs tried, RSS growth {growth / 2**20:.1f} MiB")
    assert growth < RSS_GROWTH_BYTES
