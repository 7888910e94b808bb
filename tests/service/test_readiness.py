"""Readiness tells the truth: where a model's serving version is not loaded, health (the server
and that model's name), OIP ServerReady and ModelReady say so, the reason is logged at ERROR,
and they turn back once the version loads; the API services stay SERVING throughout."""

from __future__ import annotations

import json
import os
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from liveserver import LiveServer, experiment_server
from modelkit import sequence_request, write_sequence_model
from waiting import wait_until

from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

MODEL = "seq-mini"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
API_SERVICES = ("riskscoring.v1.RiskScoring", "inference.GRPCInferenceService")


def write_experiment(config, champion: str, challenger: str) -> None:
    experiment = {"champion": champion, "challengers": [challenger], "mode": "shadow"}
    config.write_text(json.dumps({"models": {MODEL: experiment}}))
    # A later mtime whatever the filesystem's resolution: the watcher reads the file again.
    stamp = config.stat().st_mtime + 5
    os.utime(config, (stamp, stamp))


def health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def unversioned_code(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        pb_grpc.RiskScoringStub(channel).Score(sequence_request(0, 8), timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


class Watcher:
    """The statuses one `Health.Watch` stream receives, read on a thread."""

    def __init__(self, channel: grpc.Channel, service: str) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        self.call = stub.Watch(health_pb2.HealthCheckRequest(service=service))
        self.seen: list[int] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.seen.append(reply.status)
        except grpc.RpcError:
            pass  # cancelled by the test

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(timeout=10)


def test_a_missing_champion_is_not_serving_until_one_scan_loads_it(tmp_path, caplog):
    models, config = tmp_path / "models", tmp_path / "experiments.json"
    write_sequence_model(models, version="1", seed=1)
    write_sequence_model(models, version="2", seed=2)
    write_experiment(config, champion="3", challenger="2")
    with (
        experiment_server(
            models, config, tmp_path / "logs", MODEL, reload_interval_s=0
        ) as live,  # scans run when the test runs one, as the timer would
        live.channel() as channel,
    ):
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        assert health(channel) == NOT_SERVING
        assert health(channel, MODEL) == NOT_SERVING
        assert [health(channel, s) for s in API_SERVICES] == [SERVING, SERVING]
        assert not infer.ServerReady(oip.ServerReadyRequest(), timeout=10).ready
        assert not infer.ModelReady(oip.ModelReadyRequest(name=MODEL), timeout=10).ready
        named = oip.ModelReadyRequest(name=MODEL, version="2")
        assert infer.ModelReady(named, timeout=10).ready
        assert unversioned_code(channel) == grpc.StatusCode.UNAVAILABLE
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert any("version '3' (the experiment's champion) is not loaded" in m for m in errors)

        watch = Watcher(channel, MODEL)
        wait_until(lambda: watch.seen == [NOT_SERVING])
        write_sequence_model(models, version="3", seed=3)
        watcher = live.server.watcher
        assert watcher is not None
        assert live.call(watcher.scan(settle=True)) == [f"{MODEL}/3"]  # one scan
        assert health(channel) == SERVING
        assert health(channel, MODEL) == SERVING
        assert infer.ServerReady(oip.ServerReadyRequest(), timeout=10).ready
        assert infer.ModelReady(oip.ModelReadyRequest(name=MODEL), timeout=10).ready
        reply = pb_grpc.RiskScoringStub(channel).Score(sequence_request(1, 8), timeout=10)
        assert reply.model_version == "3"
        wait_until(lambda: watch.seen == [NOT_SERVING, SERVING])
        watch.close()


def test_the_experiments_file_moves_readiness_and_the_log_names_the_champion(tmp_path, caplog):
    models, config = tmp_path / "models", tmp_path / "experiments.json"
    write_sequence_model(models, version="1", seed=1)
    write_sequence_model(models, version="2", seed=2)
    write_experiment(config, champion="1", challenger="2")
    caplog.set_level("INFO", logger="service.models.registry")
    with (
        experiment_server(models, config, tmp_path / "logs", MODEL) as live,
        live.channel() as channel,
    ):
        # Read after the experiments file: the champion serves, not the highest version.
        infos = [r.getMessage() for r in caplog.records if r.name == "service.models.registry"]
        assert f"{MODEL}: version 1 serves (the experiment's champion)" in infos
        assert not any("version 2 serves" in m for m in infos)
        assert health(channel) == SERVING

        write_experiment(config, champion="9", challenger="2")  # names no folder there is
        wait_until(lambda: health(channel) == NOT_SERVING)
        assert health(channel, MODEL) == NOT_SERVING
        assert unversioned_code(channel) == grpc.StatusCode.UNAVAILABLE
        assert not live.server.registry.ready
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert any("version '9' (the experiment's champion) is not loaded" in m for m in errors)

        write_experiment(config, champion="2", challenger="1")
        wait_until(lambda: health(channel) == SERVING)
        assert health(channel, MODEL) == SERVING
        assert unversioned_code(channel) == grpc.StatusCode.OK


def test_a_draining_server_stays_not_serving(tmp_path):
    models, config = tmp_path / "models", tmp_path / "experiments.json"
    write_sequence_model(models, version="1", seed=1)
    write_sequence_model(models, version="2", seed=2)
    write_experiment(config, champion="1", challenger="2")
    with (
        experiment_server(models, config, tmp_path / "logs", MODEL) as live,
        live.channel() as channel,
    ):
        assert [health(channel, s) for s in ("", MODEL)] == [SERVING, SERVING]
        live.call(live.server.health.enter_graceful_shutdown())
        # A readiness check after the announcement (a scan, the experiments) changes nothing.
        live.call(live.server.registry.check_readiness())
        assert [health(channel, s) for s in ("", MODEL)] == [NOT_SERVING, NOT_SERVING]


def test_a_pinned_model_none_of_whose_versions_loads_is_not_serving(tmp_path):
    """A model the settings pin a version of counts for readiness though nothing of it loaded
    (its only version is broken): the server and the model are NOT_SERVING until it loads."""
    models = tmp_path / "models"
    write_sequence_model(models, version="1", seed=1)
    broken = write_sequence_model(models, name="other", version="1", seed=2)
    onnx_file = broken / "model.onnx"
    good = onnx_file.read_bytes()
    onnx_file.write_bytes(b"not an ONNX model")
    server = LiveServer(
        models_dir=models,
        default_model=MODEL,
        pinned_versions={"other": "1"},
        reload_interval_s=0,
        onnx_variants=False,
    )
    with server as live, live.channel() as channel:
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        assert health(channel) == NOT_SERVING
        assert health(channel, "other") == NOT_SERVING
        assert health(channel, MODEL) == SERVING
        assert not infer.ServerReady(oip.ServerReadyRequest(), timeout=10).ready
        onnx_file.write_bytes(good)
        watcher = live.server.watcher
        assert watcher is not None
        assert live.call(watcher.scan(settle=True)) == ["other/1"]
        assert health(channel) == SERVING
        assert infer.ServerReady(oip.ServerReadyRequest(), timeout=10).ready


def test_the_default_model_none_of_whose_versions_loads_is_not_serving(tmp_path):
    """Every request that names no model goes to the default model: where its folder is there
    and nothing of it loaded, the server is NOT_SERVING, though other models serve. A default
    the settings leave at its built-in value, with no folder, is no model of this server."""
    models = tmp_path / "models"
    write_sequence_model(models, name="other", version="1", seed=2)
    broken = write_sequence_model(models, version="1", seed=1)
    (broken / "model.onnx").write_bytes(b"not an ONNX model")
    with (
        LiveServer(models_dir=models, reload_interval_s=0, onnx_variants=False) as live,
        live.channel() as channel,
    ):
        assert health(channel) == SERVING  # the built-in default, fraud-demo, is not here
    with (
        LiveServer(
            models_dir=models, default_model=MODEL, reload_interval_s=0, onnx_variants=False
        ) as live,
        live.channel() as channel,
    ):
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        assert health(channel) == NOT_SERVING
        assert health(channel, MODEL) == NOT_SERVING
        assert health(channel, "other") == SERVING
        assert not infer.ServerReady(oip.ServerReadyRequest(), timeout=10).ready
        assert unversioned_code(channel) == grpc.StatusCode.NOT_FOUND
