"""Engine faults through a live server: a failing, NaN-returning or hung engine is taken out of
service, its traffic goes to the fallback, and the server stays SERVING."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
from fakes import expected_score, primary_and_fallback
from grpc_health.v1 import health_pb2, health_pb2_grpc
from liveserver import LiveServer
from modelkit import write_sequence_model
from onnx import TensorProto, helper, numpy_helper

from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
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


def _write_overflowing_model(root: Path) -> None:
    """`amount` in, a probability out, where any |amount| over about 3.4e8 gives NaN: a
    hidden pair of +amount·1e30 and -amount·1e30 overflows to inf and -inf, and their sum is
    NaN. A finite request, inside every check, that the model itself cannot score."""
    folder = root / "overflow" / "1"
    folder.mkdir(parents=True)
    weights = numpy_helper.from_array(np.array([[1e30, -1e30]], np.float32), "w")
    axis = numpy_helper.from_array(np.array([1], np.int64), "axis")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["hidden"]),
            helper.make_node("ReduceSum", ["hidden", "axis"], ["logit"], keepdims=1),
            helper.make_node("Sigmoid", ["logit"], ["score"]),
        ],
        "overflow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=[weights, axis],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "model.onnx")
    manifest = {
        "name": "overflow",
        "version": "1",
        "features_input": "x",
        "features": ["amount"],
        "output": "score",
        "thresholds": {"review": 0.5, "decline": 0.9},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_row_the_model_gives_no_finite_score_for_is_refused_not_decided(tmp_path):
    """No engine's non-finite check stands behind the last one tried: a request whose row the
    model turns into NaN is answered INTERNAL, on every path, and a stream's other messages
    are still scored."""
    _write_overflowing_model(tmp_path)

    def infer(amount: float, request_id: str) -> oip.ModelInferRequest:
        request = oip.ModelInferRequest(model_name="overflow", id=request_id)
        request.inputs.add(name="x", datatype="FP32", shape=[1, 1])
        request.raw_input_contents.append(np.array([[amount]], "<f4").tobytes())
        return request

    server = LiveServer(models_dir=tmp_path, default_model="overflow", onnx_variants=False)
    with server as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        inference = oip_grpc.GRPCInferenceServiceStub(channel)
        calls = {
            "Score": lambda: risk.Score(pb.ScoreRequest(features={"amount": 1e9}), timeout=10),
            "ModelInfer": lambda: inference.ModelInfer(infer(1e9, "big"), timeout=10),
        }
        failures = {}
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as failed:
                call()
            failures[name] = (failed.value.code(), failed.value.details())
        fine = risk.Score(pb.ScoreRequest(features={"amount": 0.5}), timeout=10)
        stream = inference.ModelStreamInfer(
            iter([infer(0.5, "small"), infer(1e9, "big"), infer(0.25, "smaller")]), timeout=10
        )
        answers = {r.infer_response.id or "big": r.error_message for r in stream}
    for code, details in failures.values():
        assert code == grpc.StatusCode.INTERNAL and "no finite score" in details
    assert 0 < fine.score < 1
    assert answers["small"] == answers["smaller"] == ""
    assert "no finite score" in answers["big"]
