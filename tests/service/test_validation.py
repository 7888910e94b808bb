"""Bad input gets a clear status naming the field, and the server keeps serving."""

from __future__ import annotations

import math
import os
import random
import socket

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from demo.generator import FEATURE_NAMES, HISTORY_FIELDS
from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def good_features() -> dict[str, float]:
    return {name: 1.0 for name in FEATURE_NAMES}


def good_history(rows: int = 3) -> list[pb.HistoryRow]:
    return [pb.HistoryRow(values=[0.5] * len(HISTORY_FIELDS)) for _ in range(rows)]


@pytest.fixture(scope="module")
def stub(live):
    with live.channel() as channel:
        yield pb_grpc.RiskScoringStub(channel)


@pytest.fixture(scope="module")
def oip_stub(live):
    with live.channel() as channel:
        yield oip_grpc.GRPCInferenceServiceStub(channel)


def expect(call, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    for fragment in fragments:
        assert fragment in err.value.details()
    return err.value.details()


def test_unknown_feature(stub):
    features = good_features() | {"shoe_size": 42.0}
    expect(
        lambda: stub.Score(pb.ScoreRequest(features=features), timeout=5),
        INVALID,
        "features['shoe_size']",
        "unknown feature",
    )


def test_missing_feature(stub):
    features = good_features()
    del features[FEATURE_NAMES[3]]
    expect(
        lambda: stub.Score(pb.ScoreRequest(features=features), timeout=5),
        INVALID,
        "features",
        FEATURE_NAMES[3],
    )


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_feature_rejected_by_policy(stub, value):
    features = good_features() | {FEATURE_NAMES[0]: value}
    expect(
        lambda: stub.Score(pb.ScoreRequest(features=features), timeout=5),
        INVALID,
        f"features['{FEATURE_NAMES[0]}']",
        "NaN",
    )


def test_non_finite_zeroed_where_manifest_allows(stub):
    """credit-lite's manifest says nan_policy=zero: NaN scores as 0."""
    nan = stub.Score(
        pb.ScoreRequest(
            model="credit-lite", features={f"f{i}": (math.nan if i == 0 else 1.0) for i in range(5)}
        ),
        timeout=5,
    )
    zero = stub.Score(
        pb.ScoreRequest(
            model="credit-lite", features={f"f{i}": (0.0 if i == 0 else 1.0) for i in range(5)}
        ),
        timeout=5,
    )
    assert nan.score == zero.score


def test_non_finite_history(stub):
    history = good_history()
    history[1].values[2] = math.nan
    expect(
        lambda: stub.Score(pb.ScoreRequest(features=good_features(), history=history), timeout=5),
        INVALID,
        "history",
        "NaN",
    )


def test_wrong_history_row_width(stub):
    history = good_history()
    history.append(pb.HistoryRow(values=[1.0, 2.0]))
    expect(
        lambda: stub.Score(pb.ScoreRequest(features=good_features(), history=history), timeout=5),
        INVALID,
        "history[3].values",
        f"expected {len(HISTORY_FIELDS)}",
    )


def test_history_over_the_hard_limit(stub, live):
    limit = live.server.registry.get("fraud-demo").manifest.history.max_length
    request = pb.ScoreRequest(features=good_features(), history=good_history(limit + 1))
    expect(lambda: stub.Score(request, timeout=5), INVALID, "history", f"limit of {limit}")


def test_history_on_a_model_without_one(stub):
    request = pb.ScoreRequest(
        model="credit-lite",
        features={f"f{i}": 1.0 for i in range(5)},
        history=[pb.HistoryRow(values=[1.0])],
    )
    expect(lambda: stub.Score(request, timeout=5), INVALID, "history", "no history")


def test_empty_and_oversized_batches(stub, live):
    expect(lambda: stub.ScoreBatch(pb.ScoreBatchRequest(), timeout=5), INVALID, "requests", "empty")
    limit = live.server.registry.get("fraud-demo").manifest.max_batch_size
    items = [pb.ScoreRequest(features=good_features())] * (limit + 1)
    expect(
        lambda: stub.ScoreBatch(pb.ScoreBatchRequest(requests=items), timeout=5),
        INVALID,
        "requests",
        f"limit of {limit}",
    )


def test_batch_names_the_bad_item(stub):
    items = [pb.ScoreRequest(features=good_features()) for _ in range(4)]
    items[2].features["bogus"] = 1.0
    expect(
        lambda: stub.ScoreBatch(pb.ScoreBatchRequest(requests=items), timeout=5),
        INVALID,
        "requests[2].features['bogus']",
    )


def test_unknown_model_and_version(stub):
    expect(
        lambda: stub.Score(pb.ScoreRequest(model="nope"), timeout=5),
        grpc.StatusCode.NOT_FOUND,
        "'nope'",
    )
    expect(
        lambda: stub.Score(pb.ScoreRequest(model="fraud-demo", model_version="7"), timeout=5),
        grpc.StatusCode.NOT_FOUND,
        "'7'",
    )


def infer_request(**overrides) -> oip.ModelInferRequest:
    features = np.ones((2, len(FEATURE_NAMES)), np.float32)
    history = np.zeros((2, 4, len(HISTORY_FIELDS)), np.float32)
    mask = np.ones((2, 4), np.float32)
    tensors = {"features": features, "history": history, "history_mask": mask} | overrides
    request = oip.ModelInferRequest(model_name="fraud-demo")
    for name, array in tensors.items():
        request.inputs.add(name=name, datatype="FP32", shape=list(array.shape))
        request.raw_input_contents.append(np.ascontiguousarray(array, "<f4").tobytes())
    return request


def test_oip_bad_tensors(oip_stub):
    assert len(oip_stub.ModelInfer(infer_request(), timeout=5).raw_output_contents) == 1
    expect(
        lambda: oip_stub.ModelInfer(infer_request(features=np.ones((2, 3), np.float32)), timeout=5),
        INVALID,
        "features.shape",
        f"expected {len(FEATURE_NAMES)}",
    )
    expect(
        lambda: oip_stub.ModelInfer(infer_request(bogus=np.ones((2, 1), np.float32)), timeout=5),
        INVALID,
        "inputs[3].name",
        "bogus",
    )
    request = infer_request()
    del request.inputs[2]
    del request.raw_input_contents[2]
    expect(lambda: oip_stub.ModelInfer(request, timeout=5), INVALID, "inputs", "history_mask")
    request = infer_request()
    request.raw_input_contents[0] = b"\x00" * 7
    expect(lambda: oip_stub.ModelInfer(request, timeout=5), INVALID, "raw_input_contents[0]")
    request = infer_request()
    request.inputs[0].datatype = "INT64"
    expect(lambda: oip_stub.ModelInfer(request, timeout=5), INVALID, "inputs[0].datatype")
    expect(
        lambda: oip_stub.ModelInfer(oip.ModelInferRequest(model_name="nope"), timeout=5),
        grpc.StatusCode.NOT_FOUND,
    )


def _with(shape: tuple[int, ...], index: tuple[int, ...], value: float, fill: float = 1.0):
    array = np.full(shape, fill, np.float32)
    array[index] = value
    return array


FEATURES_SHAPE, HISTORY_SHAPE, MASK_SHAPE = (
    (2, len(FEATURE_NAMES)),
    (2, 4, len(HISTORY_FIELDS)),
    (2, 4),
)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_oip_non_finite_values_name_their_input(oip_stub, value):
    features = _with(FEATURES_SHAPE, (1, 3), value)
    history = _with(HISTORY_SHAPE, (0, 2, 1), value, fill=0.0)
    for overrides, field in (
        ({"features": features}, "features"),
        ({"history": history}, "history"),
    ):
        expect(
            lambda o=overrides: oip_stub.ModelInfer(infer_request(**o), timeout=5),
            INVALID,
            field,
            "NaN or infinite",
        )


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, math.nan, math.inf])
def test_oip_mask_values_other_than_0_and_1_are_refused(oip_stub, value):
    mask = _with(MASK_SHAPE, (1, 2), value)
    expect(
        lambda: oip_stub.ModelInfer(infer_request(history_mask=mask), timeout=5),
        INVALID,
        "history_mask",
        "0 or 1",
    )


def test_oip_negative_zero_mask_is_accepted(oip_stub):
    """-0.0 is a 0 in a mask."""
    mask = _with(MASK_SHAPE, (0, 3), -0.0)
    reply = oip_stub.ModelInfer(infer_request(history_mask=mask), timeout=5)
    assert np.frombuffer(reply.raw_output_contents[0], "<f4").shape == (2,)


AMOUNT = FEATURE_NAMES.index("amount")


@pytest.mark.parametrize("value", [3e38, -5.0, float(np.finfo(np.float32).max)])
def test_a_value_outside_the_manifests_range_names_the_feature(stub, oip_stub, value):
    features = good_features() | {"amount": value}
    expect(
        lambda: stub.Score(pb.ScoreRequest(features=features), timeout=5),
        INVALID,
        "features['amount']",
        "outside the model's range [0, 1e+09]",
    )
    batch = pb.ScoreBatchRequest(
        requests=[pb.ScoreRequest(features=good_features()), pb.ScoreRequest(features=features)]
    )
    expect(lambda: stub.ScoreBatch(batch, timeout=5), INVALID, "requests[1].features['amount']")
    tensor = _with(FEATURES_SHAPE, (1, AMOUNT), value)
    expect(
        lambda: oip_stub.ModelInfer(infer_request(features=tensor), timeout=5),
        INVALID,
        "features[1]['amount']",
        "outside the model's range",
    )


def test_range_bounds_themselves_are_accepted(stub):
    features = good_features() | {"amount": 1e9, "hour_sin": -1.0, "balance": -1e9}
    assert stub.Score(pb.ScoreRequest(features=features), timeout=5).decision


def test_oip_unknown_requested_output_names_the_field(oip_stub):
    request = infer_request()
    request.outputs.add(name="score")
    assert len(oip_stub.ModelInfer(request, timeout=5).raw_output_contents) == 1
    request.outputs.add(name="logits")
    expect(lambda: oip_stub.ModelInfer(request, timeout=5), INVALID, "outputs[1].name", "'logits'")


def test_oip_requests_triton_refuses_are_refused_naming_the_field(oip_stub):
    """What Triton refuses is not half-answered: class labels asked of the score output, typed
    contents beside raw ones, raw entries that do not match the inputs."""
    request = infer_request()
    request.outputs.add(name="score").parameters["classification"].int64_param = 2
    expect(
        lambda: oip_stub.ModelInfer(request, timeout=5),
        INVALID,
        "outputs[0].parameters['classification']",
    )
    request = infer_request()
    request.inputs[1].contents.fp32_contents.extend([0.5])
    expect(
        lambda: oip_stub.ModelInfer(request, timeout=5),
        INVALID,
        "inputs[1].contents",
        "raw_input_contents",
    )
    request = infer_request()
    request.raw_input_contents.append(b"\x00" * 8)
    expect(lambda: oip_stub.ModelInfer(request, timeout=5), INVALID, "raw_input_contents", "4 ")


def test_oip_empty_model_name_names_the_field(oip_stub):
    request = infer_request()
    request.model_name = ""
    expect(lambda: oip_stub.ModelInfer(request, timeout=5), INVALID, "model_name", "is empty")
    for call in (
        lambda: oip_stub.ModelMetadata(oip.ModelMetadataRequest(name=""), timeout=5),
        lambda: oip_stub.ModelConfig(oip.ModelConfigRequest(name=""), timeout=5),
    ):
        assert expect(call, INVALID).startswith("name: is empty")


def test_burst_of_malformed_and_random_bytes_leaves_server_serving(live, stub):
    rng = random.Random(7)
    with live.channel() as channel:
        raw = {
            method: channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            for method in (
                "/riskscoring.v1.RiskScoring/Score",
                "/riskscoring.v1.RiskScoring/ScoreBatch",
                "/inference.GRPCInferenceService/ModelInfer",
            )
        }
        codes = []
        for i in range(300):
            call = raw[rng.choice(sorted(raw))]
            payload = (
                os.urandom(rng.randint(0, 400))
                if i % 2
                else bytes(rng.randint(0, 255) for _ in range(8))
            )
            try:
                call(payload, timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        assert grpc.StatusCode.INTERNAL not in codes
        assert grpc.StatusCode.UNAVAILABLE not in codes
        assert INVALID in codes
    # Garbage on the TCP port itself, not even HTTP/2.
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", live.port), timeout=5) as sock:
            sock.sendall(os.urandom(rng.randint(1, 2000)))
    with live.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reply = stub.Score(pb.ScoreRequest(features=good_features(), history=good_history()), timeout=5)
    assert 0.0 <= reply.score <= 1.0
