"""The do-nothing servers answer what the benchmarks send them, as riskserve would shape it."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from bench.model_io import DEMO_MODEL_PATH
from bench.rpc_floor import echo_spec
from bench.servers import ServerProcess, free_port
from engines.manifest import load_manifest
from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

MANIFEST = load_manifest(DEMO_MODEL_PATH.parent)


def _serve(
    sync: bool, tmp_path_factory: pytest.TempPathFactory, engine: bool = False
) -> Iterator[grpc.Channel]:
    log = tmp_path_factory.mktemp("floor") / "floor.log"
    with (
        ServerProcess(echo_spec(free_port(), sync=sync, engine=engine), log) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        yield channel


@pytest.fixture(scope="module")
def floor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[grpc.Channel]:
    """The grpc.aio floor, which serves OIP and riskserve's own service."""
    yield from _serve(False, tmp_path_factory)


@pytest.fixture(scope="module", params=[False, True], ids=["grpc.aio", "thread-pool"])
def oip_floor(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[grpc.Channel]:
    """Either floor: the thread-pool one serves OIP only (perf_analyzer's calls)."""
    yield from _serve(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def engine_floor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[grpc.Channel]:
    """The grpc.aio floor that runs the demo model on each request's rows."""
    yield from _serve(False, tmp_path_factory, engine=True)


def _score_request(**features: float) -> pb.ScoreRequest:
    values = dict.fromkeys(MANIFEST.features, 0.0) | features
    return pb.ScoreRequest(request_id="r1", model=MANIFEST.name, features=values)


def test_model_infer_is_answered_with_one_zero_score_a_row(oip_floor: grpc.Channel) -> None:
    channel = oip_floor
    request = oip.ModelInferRequest(model_name=MANIFEST.name, id="a")
    request.inputs.add(name=MANIFEST.features_input, datatype="FP32", shape=[3, 31])
    reply = oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
    assert reply.id == "a"
    assert list(reply.outputs[0].shape) == [3, 1]
    assert np.frombuffer(reply.raw_output_contents[0], dtype="<f4").tolist() == [0.0] * 3


def test_the_scoring_service_describes_the_demo_model_as_its_manifest_does(
    floor: grpc.Channel,
) -> None:
    info = pb_grpc.RiskScoringStub(floor).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert info.model == MANIFEST.name
    assert tuple(info.feature_names) == MANIFEST.features
    assert MANIFEST.history is not None
    assert tuple(info.history_fields) == MANIFEST.history.fields
    assert info.max_history_length == MANIFEST.history.max_length


def test_valid_scores_are_answered_and_invalid_features_refused_by_name(
    floor: grpc.Channel,
) -> None:
    stub = pb_grpc.RiskScoringStub(floor)
    reply = stub.Score(_score_request(), timeout=10)
    assert (reply.request_id, reply.decision) == ("r1", pb.APPROVE)

    for bad, name in ((_score_request(amount=float("nan")), "amount"), (_unknown(), "unknown")):
        with pytest.raises(grpc.RpcError) as refused:
            stub.Score(bad, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert name in refused.value.details()

    batch = pb.ScoreBatchRequest(requests=[_score_request(), _score_request()])
    assert len(stub.ScoreBatch(batch, timeout=10).responses) == 2
    answers = list(stub.ScoreStream(iter([_unknown(), _score_request()]), timeout=10))
    assert [a.status.code for a in answers] == [grpc.StatusCode.INVALID_ARGUMENT.value[0], 0]
    assert answers[1].decision == pb.APPROVE


def _unknown() -> pb.ScoreRequest:
    request = _score_request()
    request.features["unknown"] = 1.0
    return request


def test_the_load_test_sweep_starts_the_floor_for_its_floor_config() -> None:
    from bench.loadtest_sweep import FLOOR, _processes, _spec

    spec, _ = _spec(FLOOR, budget_ms=10.0)
    assert spec.name == FLOOR and _processes(FLOOR) == 1


def test_the_engine_floor_answers_the_models_own_scores(engine_floor: grpc.Channel) -> None:
    import onnxruntime as ort

    session = ort.InferenceSession(str(DEMO_MODEL_PATH), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    features = rng.uniform(0.0, 1.0, len(MANIFEST.features)).astype(np.float32)
    history = rng.uniform(0.0, 1.0, (5, 8)).astype(np.float32)
    expected = session.run(
        None,
        {
            "features": features[None, :],
            "history": history[None, :, :],
            "history_mask": np.ones((1, 5), dtype=np.float32),
        },
    )[0].item()

    request = pb.ScoreRequest(features=dict(zip(MANIFEST.features, features.tolist(), strict=True)))
    for row in history:
        request.history.add(values=row.tolist())
    stub = pb_grpc.RiskScoringStub(engine_floor)
    reply = stub.Score(request, timeout=30)
    assert reply.score == pytest.approx(expected, abs=1e-5)
    assert reply.engine == "onnxruntime"
    batch = stub.ScoreBatch(pb.ScoreBatchRequest(requests=[request, _score_request()]), timeout=30)
    assert batch.responses[0].score == pytest.approx(expected, abs=1e-5)

    infer = oip.ModelInferRequest(model_name=MANIFEST.name)
    for name, array in (
        ("features", features[None, :]),
        ("history", history[None, :, :]),
        ("history_mask", np.ones((1, 5), dtype=np.float32)),
    ):
        infer.inputs.add(name=name, datatype="FP32", shape=list(array.shape))
        infer.raw_input_contents.append(array.astype("<f4").tobytes())
    answer = oip_grpc.GRPCInferenceServiceStub(engine_floor).ModelInfer(infer, timeout=30)
    scores = np.frombuffer(answer.raw_output_contents[0], dtype="<f4")
    assert scores.tolist() == pytest.approx([expected], abs=1e-5)
