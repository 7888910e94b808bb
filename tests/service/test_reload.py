"""Hot reload: a new version folder is loaded beside the old, switched to atomically, and the old
one drained and unloaded, while clients keep scoring without a single failed request."""

from __future__ import annotations

import shutil
import signal
import threading
import time

import grpc
from liveserver import LiveServer, server_process
from modelkit import write_tabular_model

from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

CLIENTS = 6


def request(i: int) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=str(i), features={f"f{j}": 0.2 * j for j in range(5)})


def test_new_version_replaces_the_old_under_load(tmp_path):
    models = tmp_path / "models"
    write_tabular_model(models, version="1", seed=0)
    staged = write_tabular_model(tmp_path / "staging", version="2", seed=1)
    server = LiveServer(
        models_dir=models,
        default_model="credit-lite",
        reload_interval_s=0.1,
        reload_drain_s=2,
        budget_ms=3000,
        onnx_variants=False,
        tensorrt=False,
    )
    stop = threading.Event()
    versions: list[str] = []
    failures: list[grpc.StatusCode] = []
    lock = threading.Lock()

    def client(stub: pb_grpc.RiskScoringStub, k: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                reply = stub.Score(request(k * 100_000 + i), timeout=5)
                with lock:
                    versions.append(reply.model_version)
            except grpc.RpcError as exc:
                with lock:
                    failures.append(exc.code())
            i += 1

    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        threads = [threading.Thread(target=client, args=(stub, k)) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            shutil.copytree(staged, models / "credit-lite" / "2")  # not atomic, file by file
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                with lock:
                    if versions[-CLIENTS:] == ["2"] * CLIENTS:
                        break
                time.sleep(0.05)
            time.sleep(0.3)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=10)
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5)
        last = stub.Score(request(0), timeout=5)

    assert failures == []
    assert versions[0] == "1" and versions[-1] == "2"
    switch = versions.index("2")
    # Once a request saw 2, a request could only see 1 if it was already queued on version 1.
    assert versions[switch + 4 * CLIENTS :].count("1") == 0
    assert last.model_version == "2"
    assert (info.model_version, list(info.versions)) == ("2", ["2"])  # version 1 unloaded
    print(f"reload: {len(versions)} requests, none failed, switched after {switch}")


def test_sighup_loads_a_new_version_at_once(tmp_path):
    models = tmp_path / "models"
    write_tabular_model(models, version="1")
    env = {"RISKSERVE_DEFAULT_MODEL": "credit-lite", "RISKSERVE_ONNX_VARIANTS": "false"}
    with (
        server_process(models, **env) as (proc, target),
        grpc.insecure_channel(target) as channel,
    ):
        stub = pb_grpc.RiskScoringStub(channel)
        assert stub.Score(request(1), timeout=5).model_version == "1"
        write_tabular_model(models, version="7", seed=3)
        time.sleep(0.3)  # polling is off: nothing changes until the signal
        assert stub.Score(request(2), timeout=5).model_version == "1"
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while stub.Score(request(3), timeout=5).model_version != "7":
            assert time.monotonic() < deadline, "SIGHUP did not load version 7"
            time.sleep(0.05)
        assert proc.poll() is None
