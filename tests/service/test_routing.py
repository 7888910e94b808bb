"""One routing rule on every scoring path: a request naming no version gets the serving version
(the experiment's champion, else a pinned version, else the highest), each batch row is routed
by its own entity, and what a row was answered by is what the experiment log says."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from liveserver import LiveServer
from liveserver import experiment_server as live_experiments
from modelkit import write_sequence_model
from waiting import wait_until

from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.shadow import ExperimentConfig, ExperimentRouter, NoRecords, read_records

MODEL = "seq-mini"


def score_request(i: int, entity: str | None = None) -> pb.ScoreRequest:
    rng = np.random.default_rng(i)
    return pb.ScoreRequest(
        request_id=f"r{i}",
        entity_id=entity if entity is not None else f"acct-{i}",
        features={f"x{j}": float(v) for j, v in enumerate(rng.normal(size=4))},
        history=[pb.HistoryRow(values=rng.normal(size=3).tolist()) for _ in range(1 + i % 4)],
    )


def feed(requests: list[pb.ScoreRequest]) -> dict[str, np.ndarray]:
    """The model inputs of `requests`, padded as the server pads them."""
    length = max(len(r.history) for r in requests)
    history = np.zeros((len(requests), length, 3), np.float32)
    mask = np.zeros((len(requests), length), np.float32)
    for i, r in enumerate(requests):
        history[i, : len(r.history)] = [row.values for row in r.history]
        mask[i, : len(r.history)] = 1.0
    features = np.array([[r.features[f"x{j}"] for j in range(4)] for r in requests], np.float32)
    return {"features": features, "history": history, "history_mask": mask}


def direct(version_dir: Path, requests: list[pb.ScoreRequest]) -> list[float]:
    """What ONNX Runtime, run here, scores the requests with one version."""
    session = ort.InferenceSession(
        str(version_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    return session.run(["score"], feed(requests))[0].reshape(-1).tolist()


def infer_request(
    requests: list[pb.ScoreRequest], request_id: str = "inf-1", **parameters: str
) -> oip.ModelInferRequest:
    message = oip.ModelInferRequest(model_name=MODEL, id=request_id)
    for name, array in feed(requests).items():
        message.inputs.add(name=name, datatype="FP32", shape=list(array.shape))
        message.raw_input_contents.append(array.astype("<f4").tobytes())
    for key, value in parameters.items():
        message.parameters[key].string_param = value
    return message


def served_records(logs: Path) -> dict[str, dict]:
    try:
        table = read_records(str(logs)).drop_columns(["time"]).to_pylist()
    except NoRecords:
        return {}
    return {r["request_id"]: r for r in table if r["served"]}


def shadow_records(logs: Path) -> dict[str, dict]:
    try:
        table = read_records(str(logs)).drop_columns(["time"]).to_pylist()
    except NoRecords:
        return {}
    return {r["request_id"]: r for r in table if not r["served"]}


def write_experiment(path: Path, **experiment: object) -> dict:
    config = {"models": {MODEL: {"champion": "1", "challengers": ["2"], **experiment}}}
    path.write_text(json.dumps(config))
    return config


@pytest.fixture()
def models(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    write_sequence_model(root, version="1", seed=1)
    write_sequence_model(root, version="2", seed=2)
    return root


def experiment_server(models: Path, config: Path, logs: Path, **settings: object) -> LiveServer:
    return live_experiments(models, config, logs, MODEL, **settings)


def test_every_path_answers_unversioned_calls_with_the_champion_and_logs_them(models, tmp_path):
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    write_experiment(config, mode="shadow")
    v1, v2 = models / MODEL / "1", models / MODEL / "2"
    reqs = [score_request(i) for i in range(6)]
    with experiment_server(models, config, logs) as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        single = risk.Score(reqs[0], timeout=10)
        batch = risk.ScoreBatch(pb.ScoreBatchRequest(requests=reqs[1:4]), timeout=10)
        inferred = infer.ModelInfer(infer_request(reqs[4:6], entity_id="acct-oip"), timeout=10)
        named = risk.Score(pb.ScoreRequest(**_fields(reqs[0]), model_version="2"), timeout=10)
        info = risk.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        metadata = infer.ModelMetadata(oip.ModelMetadataRequest(name=MODEL), timeout=10)
        config_reply = infer.ModelConfig(oip.ModelConfigRequest(name=MODEL), timeout=10)
        ready = infer.ModelReady(oip.ModelReadyRequest(name=MODEL), timeout=10)

        champion = direct(v1, reqs)
        assert single.model_version == "1"
        assert single.score == pytest.approx(champion[0], abs=1e-6)
        assert [r.model_version for r in batch.responses] == ["1"] * 3
        assert [r.request_id for r in batch.responses] == ["r1", "r2", "r3"]
        assert [r.score for r in batch.responses] == pytest.approx(champion[1:4], abs=1e-6)
        assert inferred.model_version == "1"
        oip_scores = np.frombuffer(inferred.raw_output_contents[0], "<f4").tolist()
        assert oip_scores == pytest.approx(champion[4:6], abs=1e-6)
        assert oip_scores != pytest.approx(direct(v2, reqs[4:6]), abs=1e-3)
        # The challenger answers only a caller that names it, and that call is not logged.
        assert named.model_version == "2"
        assert named.score == pytest.approx(direct(v2, reqs[:1])[0], abs=1e-6)
        assert (info.model_version, list(info.versions)) == ("1", ["1", "2"])
        assert ready.ready and config_reply.config.name == MODEL
        assert [i.name for i in metadata.inputs] == ["features", "history", "history_mask"]

        logged = {"r0", "r1", "r2", "r3", "inf-1/0", "inf-1/1"}
        wait_until(lambda: logged <= set(served_records(logs)) <= logged)
        wait_until(lambda: logged <= set(shadow_records(logs)))
    served = served_records(logs)
    assert set(served) == logged  # the named-version call is outside the experiment
    assert {(r["version"], r["arm"], r["mode"]) for r in served.values()} == {
        ("1", "champion", "shadow")
    }
    assert served["inf-1/1"]["entity_id"] == "acct-oip"
    assert served["r2"]["entity_id"] == "acct-2"
    shadows = shadow_records(logs)
    assert {r["version"] for r in shadows.values()} == {"2"}
    assert shadows["r3"]["score"] == pytest.approx(direct(v2, reqs)[3], abs=1e-5)


def test_stream_messages_follow_the_routing_rule_and_are_logged(models, tmp_path):
    """ScoreStream and ModelStreamInfer route each message as Score and ModelInfer do."""
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    write_experiment(config, mode="shadow")
    v1 = models / MODEL / "1"
    reqs = [score_request(i) for i in range(10, 14)]
    oip_request = infer_request(reqs[2:4], "stream-inf", entity_id="acct-stream")
    with experiment_server(models, config, logs) as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        scored = list(risk.ScoreStream(iter(reqs[:2]), timeout=10))
        inferred = list(infer.ModelStreamInfer(iter([oip_request]), timeout=10))

        champion = direct(v1, reqs)
        assert sorted(r.request_id for r in scored) == ["r10", "r11"]
        assert {r.model_version for r in scored} == {"1"}
        by_id = {r.request_id: r.score for r in scored}
        assert [by_id["r10"], by_id["r11"]] == pytest.approx(champion[:2], abs=1e-6)
        assert [m.error_message for m in inferred] == [""]
        reply = inferred[0].infer_response
        assert reply.model_version == "1" and reply.id == "stream-inf"
        scores = np.frombuffer(reply.raw_output_contents[0], "<f4").tolist()
        assert scores == pytest.approx(champion[2:4], abs=1e-6)

        logged = {"r10", "r11", "stream-inf/0", "stream-inf/1"}
        wait_until(lambda: logged <= set(served_records(logs)))
    served = served_records(logs)
    assert {served[i]["version"] for i in logged} == {"1"}
    assert served["stream-inf/0"]["entity_id"] == "acct-stream"


def _fields(request: pb.ScoreRequest) -> dict:
    return {
        "request_id": request.request_id,
        "entity_id": request.entity_id,
        "features": dict(request.features),
        "history": list(request.history),
    }


def test_ab_batch_is_routed_per_row_answered_in_order_and_logged_per_row(models, tmp_path):
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    router = ExperimentRouter(
        ExperimentConfig.model_validate(write_experiment(config, mode="ab", ab_share=0.5))
    )
    reqs = [score_request(i) for i in range(24)]
    arms = [router.route(MODEL, r.entity_id).serving_version for r in reqs]
    assert set(arms) == {"1", "2"}  # the batch spans both arms
    expected = {
        "1": dict(zip(range(24), direct(models / MODEL / "1", reqs), strict=True)),
        "2": dict(zip(range(24), direct(models / MODEL / "2", reqs), strict=True)),
    }
    challenger_entity = next(r.entity_id for r, arm in zip(reqs, arms, strict=True) if arm == "2")
    with experiment_server(models, config, logs) as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        batch = risk.ScoreBatch(pb.ScoreBatchRequest(requests=reqs), timeout=10)
        singles = [risk.Score(r, timeout=10) for r in reqs[:6]]
        inferred = infer.ModelInfer(
            infer_request(reqs[:1], entity_id=challenger_entity), timeout=10
        )
        anonymous = infer.ModelInfer(infer_request(reqs[1:2], "inf-2"), timeout=10)
        logged = {f"r{i}" for i in range(24)} | {"inf-1", "inf-2"}
        wait_until(lambda: logged <= set(served_records(logs)))

    assert [r.request_id for r in batch.responses] == [r.request_id for r in reqs]
    assert [r.model_version for r in batch.responses] == arms
    for i, reply in enumerate(batch.responses):
        assert reply.score == pytest.approx(expected[arms[i]][i], abs=1e-6)
    # A unary call from the same entity lands on the same arm as its batch row.
    assert [r.model_version for r in singles] == arms[:6]
    assert inferred.model_version == "2"
    assert anonymous.model_version == "1"  # no entity: never drawn into a challenger's share
    served = served_records(logs)
    for i, request in enumerate(reqs):
        record = served[request.request_id]
        assert (record["version"], record["entity_id"], record["mode"]) == (
            arms[i],
            request.entity_id,
            "ab",
        )
        assert record["arm"] == ("champion" if arms[i] == "1" else "challenger")
        assert record["score"] == pytest.approx(batch.responses[i].score, abs=1e-6)
    assert (served["inf-1"]["version"], served["inf-1"]["arm"]) == ("2", "challenger")
    assert (served["inf-2"]["version"], served["inf-2"]["entity_id"]) == ("1", "")
    assert shadow_records(logs) == {}  # A/B serves each arm; nothing is scored aside


def test_a_new_version_changes_nothing_for_unversioned_callers_under_an_experiment(
    models, tmp_path
):
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    write_experiment(config, mode="shadow")
    reqs = [score_request(i) for i in range(4)]
    with (
        experiment_server(models, config, logs, reload_interval_s=0.1) as live,
        live.channel() as channel,
    ):
        risk = pb_grpc.RiskScoringStub(channel)
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        assert risk.Score(reqs[0], timeout=10).model_version == "1"
        write_sequence_model(models, version="3", seed=3)
        registry = live.server.registry
        wait_until(lambda: registry.versions(MODEL) == ["1", "2", "3"])

        assert risk.Score(reqs[1], timeout=10).model_version == "1"
        batch = risk.ScoreBatch(pb.ScoreBatchRequest(requests=reqs), timeout=10)
        assert [r.model_version for r in batch.responses] == ["1"] * 4
        assert infer.ModelInfer(infer_request(reqs[:1]), timeout=10).model_version == "1"
        assert risk.GetModelInfo(pb.ModelInfoRequest(), timeout=10).model_version == "1"
        named = risk.Score(pb.ScoreRequest(**_fields(reqs[2]), model_version="3"), timeout=10)
        assert named.model_version == "3"
        assert live.server.watcher.swaps == 0


def test_a_pinned_version_serves_until_the_pin_changes_nothing_else(models):
    with (
        LiveServer(
            models_dir=models,
            default_model=MODEL,
            pinned_versions={MODEL: "1"},
            reload_interval_s=0.1,
            budget_ms=5000,
            onnx_variants=False,
            tensorrt=False,
        ) as live,
        live.channel() as channel,
    ):
        risk = pb_grpc.RiskScoringStub(channel)
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        write_sequence_model(models, version="3", seed=3)
        wait_until(lambda: live.server.registry.versions(MODEL) == ["1", "2", "3"])
        reqs = [score_request(i) for i in range(3)]
        assert risk.Score(reqs[0], timeout=10).model_version == "1"
        batch = risk.ScoreBatch(pb.ScoreBatchRequest(requests=reqs), timeout=10)
        assert [r.model_version for r in batch.responses] == ["1"] * 3
        assert infer.ModelInfer(infer_request(reqs[:1]), timeout=10).model_version == "1"


def test_a_champion_that_is_not_loaded_is_unavailable_not_replaced(models, tmp_path):
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    config.write_text(json.dumps({"models": {MODEL: {"champion": "5", "challengers": ["2"]}}}))
    with experiment_server(models, config, logs) as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            risk.Score(score_request(0), timeout=10)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "version '5'" in (failed.value.details() or "")
        assert not infer.ModelReady(oip.ModelReadyRequest(name=MODEL), timeout=10).ready
        named = risk.Score(pb.ScoreRequest(**_fields(score_request(1)), model_version="2"))
        assert named.model_version == "2"

        # An A/B challenger that is not loaded: its entities are refused, not served another.
        ab = {"champion": "1", "challengers": ["9"], "mode": "ab", "ab_share": 1.0}
        config.write_text(json.dumps({"models": {MODEL: ab}}))
        anonymous = score_request(4, entity="")  # no entity: the champion, which is loaded
        wait_until(lambda: _code(lambda: risk.Score(anonymous, timeout=10)) == "OK")
        assert risk.Score(anonymous, timeout=10).model_version == "1"
        assert _code(lambda: risk.Score(score_request(2), timeout=10)) == "UNAVAILABLE"
        batch = pb.ScoreBatchRequest(requests=[score_request(3)])
        assert _code(lambda: risk.ScoreBatch(batch, timeout=10)) == "UNAVAILABLE"


def _code(call: Callable[[], object]) -> str:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def test_promoting_the_challenger_in_the_experiment_file_moves_every_path(models, tmp_path):
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    write_experiment(config, mode="shadow")
    reqs = [score_request(i) for i in range(3)]
    with experiment_server(models, config, logs) as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        assert risk.Score(reqs[0], timeout=10).model_version == "1"
        promoted = {"models": {MODEL: {"champion": "2", "challengers": ["1"]}}}
        config.write_text(json.dumps(promoted))
        wait_until(lambda: risk.Score(reqs[0], timeout=10).model_version == "2")
        batch = risk.ScoreBatch(pb.ScoreBatchRequest(requests=reqs), timeout=10)
        assert [r.model_version for r in batch.responses] == ["2"] * 3
        assert infer.ModelInfer(infer_request(reqs[:1]), timeout=10).model_version == "2"
        assert risk.GetModelInfo(pb.ModelInfoRequest(), timeout=10).model_version == "2"


def test_a_challenger_replaced_in_place_is_shadow_scored_with_its_new_files(models, tmp_path):
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    write_experiment(config, mode="shadow")
    challenger = models / MODEL / "2"
    fixed = write_sequence_model(tmp_path / "fixed", version="2", seed=7)
    reqs = [score_request(i) for i in range(4)]
    with experiment_server(models, config, logs) as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        watcher = live.server.watcher
        assert watcher is not None
        risk.Score(reqs[0], timeout=10)
        wait_until(lambda: "r0" in shadow_records(logs))
        for name in ("model.onnx", "manifest.json"):
            (challenger / name).write_bytes((fixed / name).read_bytes())
        assert live.call(watcher.scan(settle=True)) == [f"{MODEL}/2"]
        for request in reqs[1:]:
            assert risk.Score(request, timeout=10).model_version == "1"
        wait_until(lambda: {"r1", "r2", "r3"} <= set(shadow_records(logs)))
    shadows = shadow_records(logs)
    new_scores = direct(fixed, reqs)
    for i in (1, 2, 3):
        assert shadows[f"r{i}"]["score"] == pytest.approx(new_scores[i], abs=1e-5)
    assert shadows["r0"]["score"] != pytest.approx(new_scores[0], abs=1e-3)


def _ab_of_two_lengths(tmp_path: Path) -> tuple[Path, Path, Path, ExperimentRouter]:
    """Versions 1 (16 history rows at most) and 2 (8) of MODEL in an even A/B experiment:
    the models folder, the experiments file, the log prefix, and the experiment's router."""
    models = tmp_path / "models"
    write_sequence_model(models, version="1", seed=1, max_length=16)
    write_sequence_model(models, version="2", seed=2, max_length=8)
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    router = ExperimentRouter(
        ExperimentConfig.model_validate(write_experiment(config, mode="ab", ab_share=0.5))
    )
    return models, config, logs, router


def test_versions_with_different_manifests_each_decode_their_own_rows(tmp_path):
    models, config, logs, router = _ab_of_two_lengths(tmp_path)
    reqs = [score_request(i) for i in range(12)]
    arms = [router.route(MODEL, r.entity_id).serving_version for r in reqs]
    assert set(arms) == {"1", "2"}
    with experiment_server(models, config, logs) as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        batch = risk.ScoreBatch(pb.ScoreBatchRequest(requests=reqs), timeout=10)
        info = risk.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        named = risk.GetModelInfo(pb.ModelInfoRequest(model_version="2"), timeout=10)
        bad = infer_request(reqs[:1])
        bad.parameters["entity_id"].int64_param = 7
        with pytest.raises(grpc.RpcError) as failed:
            infer.ModelInfer(bad, timeout=10)
    assert [r.model_version for r in batch.responses] == arms
    for version in ("1", "2"):
        rows = [i for i, arm in enumerate(arms) if arm == version]
        scores = direct(models / MODEL / version, [reqs[i] for i in rows])
        assert [batch.responses[i].score for i in rows] == pytest.approx(scores, abs=1e-6)
    assert (info.model_version, info.max_history_length) == ("1", 16)
    assert (named.model_version, named.max_history_length) == ("2", 8)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameters['entity_id']" in (failed.value.details() or "")


def test_a_batch_row_is_checked_only_by_the_version_that_answers_it(tmp_path):
    """Version 1 takes 16 history rows, version 2 takes 8: a row of 12 routed to version 1 is
    answered in a batch beside version 2's rows, and a row's field is named by its place. An
    empty batch, and a row naming another version than its batch, are refused as without an
    experiment."""
    models, config, logs, router = _ab_of_two_lengths(tmp_path)
    entities = [f"acct-{i}" for i in range(64)]
    to_one = next(e for e in entities if router.route(MODEL, e).serving_version == "1")
    to_two = next(e for e in entities if router.route(MODEL, e).serving_version == "2")
    long = score_request(1, to_one)
    long.history.extend([pb.HistoryRow(values=[0.1, 0.2, 0.3])] * (12 - len(long.history)))
    short = score_request(2, to_two)
    too_long = score_request(3, to_one)
    too_long.history.extend([pb.HistoryRow(values=[0.1, 0.2, 0.3])] * 20)
    named = score_request(4, to_one)
    named.model_version = "2"

    def refused(stub: pb_grpc.RiskScoringStub, request: pb.ScoreBatchRequest) -> str:
        with pytest.raises(grpc.RpcError) as failed:
            stub.ScoreBatch(request, timeout=10)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return failed.value.details() or ""

    with experiment_server(models, config, logs) as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        batch = risk.ScoreBatch(pb.ScoreBatchRequest(requests=[short, long]), timeout=10)
        beyond = refused(risk, pb.ScoreBatchRequest(requests=[short, too_long]))
        empty = refused(risk, pb.ScoreBatchRequest())
        other = refused(risk, pb.ScoreBatchRequest(requests=[short, named]))
    assert [r.model_version for r in batch.responses] == ["2", "1"]
    assert batch.responses[1].score == pytest.approx(direct(models / MODEL / "1", [long])[0])
    assert beyond.startswith("requests[1].history: 24 rows exceed the limit of 16")
    assert empty == "requests: is empty"
    assert other.startswith("requests[1].model_version: must be empty or equal")


def test_shadow_share_applies_per_row_of_a_batch(models, tmp_path):
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    router = ExperimentRouter(
        ExperimentConfig.model_validate(write_experiment(config, shadow_share=0.5))
    )
    reqs = [score_request(i) for i in range(24)]
    copied = {r.request_id for r in reqs if router.route(MODEL, r.entity_id).shadow_versions}
    assert 0 < len(copied) < len(reqs)
    with experiment_server(models, config, logs) as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        batch = risk.ScoreBatch(pb.ScoreBatchRequest(requests=reqs), timeout=10)
        wait_until(lambda: len(served_records(logs)) == len(reqs))
        wait_until(lambda: set(shadow_records(logs)) == copied)
        runner = live.server.experiments.runner
        wait_until(lambda: runner.completed == runner.submitted)
    assert [r.model_version for r in batch.responses] == ["1"] * len(reqs)
    assert set(shadow_records(logs)) == copied  # only the rows of shadowed entities
    challenger = direct(models / MODEL / "2", reqs)
    shadows = shadow_records(logs)
    for i, request in enumerate(reqs):
        if request.request_id in copied:
            assert shadows[request.request_id]["score"] == pytest.approx(challenger[i], abs=1e-5)


def test_requests_sent_without_an_id_are_logged_under_one_each_arm_shares(models, tmp_path):
    """The report pairs the arms by request id: a request without one is logged under an id
    of its own, the same for its champion and shadow records."""
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    write_experiment(config)
    reqs = [score_request(i) for i in range(6)]
    for r in reqs:
        r.request_id = ""
    with experiment_server(models, config, logs) as live, live.channel() as channel:
        risk = pb_grpc.RiskScoringStub(channel)
        risk.Score(reqs[0], timeout=10)
        risk.ScoreBatch(pb.ScoreBatchRequest(requests=reqs[1:]), timeout=10)
        wait_until(lambda: len(served_records(logs)) == len(reqs))
        wait_until(lambda: len(shadow_records(logs)) == len(reqs))
    served, shadowed = served_records(logs), shadow_records(logs)
    assert "" not in served and set(served) == set(shadowed)
