"""Hot reload: a new version folder is loaded beside the old, switched to atomically, and the old
one drained and unloaded, while clients keep scoring without a single failed request; a version
whose files change in place is reloaded the same way, or refused loudly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from liveserver import LiveServer, server_process
from modelkit import add_validated_variants, write_tabular_model
from scrape import scraped_total
from waiting import wait_until

from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

CLIENTS = 6


def request(i: int) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=str(i), features={f"f{j}": 0.2 * j for j in range(5)})


def reload_server(models: Path, **settings: object) -> LiveServer:
    """A live server on `models` serving credit-lite, scanning for versions every 0.1 s, with
    ONNX Runtime's FP32 engine only; `settings` add to or replace these."""
    defaults: dict[str, object] = dict(
        default_model="credit-lite",
        reload_interval_s=0.1,
        budget_ms=3000,
        onnx_variants=False,
        tensorrt=False,
    )
    return LiveServer(models_dir=models, **{**defaults, **settings})


@contextmanager
def scoring_traffic(
    stub: pb_grpc.RiskScoringStub, message: pb.ScoreRequest
) -> Iterator[tuple[list[pb.ScoreResponse], list[grpc.StatusCode]]]:
    """CLIENTS threads scoring `message` in a loop until the block ends; yields the replies
    and the failures' codes, appended as they come."""
    stop = threading.Event()
    replies: list[pb.ScoreResponse] = []
    failures: list[grpc.StatusCode] = []
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            try:
                reply = stub.Score(message, timeout=5)
                with lock:
                    replies.append(reply)
            except grpc.RpcError as exc:
                with lock:
                    failures.append(exc.code())

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        yield replies, failures
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)


def test_new_version_replaces_the_old_under_load(tmp_path):
    models = tmp_path / "models"
    write_tabular_model(models, version="1", seed=0)
    staged = write_tabular_model(tmp_path / "staging", version="2", seed=1)
    server = reload_server(models, reload_drain_s=2)
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
            wait_until(lambda: len(versions) >= 5 * CLIENTS)  # the load is going, on 1
            shutil.copytree(staged, models / "credit-lite" / "2")  # not atomic, file by file
            wait_until(lambda: versions[-CLIENTS:] == ["2"] * CLIENTS)
            # Enough replies after the switch for the check below to see any stray 1.
            wait_until(lambda: len(versions) - versions.index("2") >= 10 * CLIENTS)
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
        # Polling is off by default (no scan runs on a timer): nothing changes until the signal.
        assert stub.Score(request(2), timeout=5).model_version == "1"
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: stub.Score(request(3), timeout=5).model_version == "7")
        before = stub.Score(request(4), timeout=5).score
        write_tabular_model(models, version="7", seed=4)  # version 7's files, in place
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: stub.Score(request(5), timeout=5).score != before)
        after = stub.Score(request(6), timeout=5)
        expected = direct_score(models / "credit-lite" / "7", [0.2 * j for j in range(5)])
        assert (after.model_version, after.score) == ("7", pytest.approx(expected, abs=1e-6))
        assert proc.poll() is None


def direct_score(version_dir: Path, features: list[float], file: str = "model.onnx") -> float:
    session = ort.InferenceSession(str(version_dir / file), providers=["CPUExecutionProvider"])
    return float(session.run(["score"], {"x": np.array([features], np.float32)})[0][0, 0])


def replace_files(source: Path, target: Path) -> None:
    """Overwrite a version's files in place, the ONNX file first, as a deploy script would."""
    for name in ("model.onnx", "manifest.json"):
        shutil.copyfile(source / name, target / name)


def reloads(url: str, outcome: str) -> float:
    return scraped_total(url, "riskserve_model_reloads_total", outcome=outcome)


def test_version_replaced_in_place_is_served_after_one_scan_under_load(tmp_path):
    models = tmp_path / "models"
    served_dir = write_tabular_model(models, version="1", seed=0)
    fixed = write_tabular_model(tmp_path / "fixed", version="1", seed=1)
    manifest = json.loads((fixed / "manifest.json").read_text())
    manifest["thresholds"] = {"review": 0.0, "decline": 0.0}  # every score now declines
    (fixed / "manifest.json").write_text(json.dumps(manifest))
    features = [0.2 * j for j in range(5)]
    old, new = direct_score(served_dir, features), direct_score(fixed, features)
    assert abs(old - new) > 1e-3
    server = reload_server(
        models,
        reload_interval_s=0,  # scans happen when the test runs one, as the timer would
        reload_drain_s=2,
    )
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        watcher = server.server.watcher
        assert watcher is not None
        with scoring_traffic(stub, request(0)) as (replies, failures):
            wait_until(lambda: len(replies) > 50)
            replace_files(fixed, served_dir)
            assert server.call(watcher.scan(settle=True)) == ["credit-lite/1"]  # the first scan
            seen = len(replies)
            wait_until(lambda: len(replies) > seen + 50)
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5)

    assert failures == []
    assert {round(r.score, 5) for r in replies} == {round(old, 5), round(new, 5)}
    assert replies[0].score == pytest.approx(old, abs=1e-6)
    assert replies[0].decision == (
        pb.APPROVE if old < 0.5 else pb.REVIEW if old < 0.9 else pb.DECLINE
    )
    # Once the scan returned, the old instance had drained: past the one request each client
    # may still have had on its way back, every reply has the new weights and thresholds.
    for reply in replies[seen + CLIENTS :]:
        assert reply.score == pytest.approx(new, abs=1e-6)
        assert reply.decision == pb.DECLINE
    assert (info.model_version, list(info.versions)) == ("1", ["1"])
    assert (watcher.reloads, watcher.refused) == (1, 0)


def test_changed_files_that_do_not_load_are_refused_logged_and_counted(tmp_path, caplog):
    models = tmp_path / "models"
    served_dir = write_tabular_model(models, version="1", seed=0)
    fixed = write_tabular_model(tmp_path / "fixed", version="1", seed=1)
    features = [0.2 * j for j in range(5)]
    old, new = direct_score(served_dir, features), direct_score(fixed, features)
    server = reload_server(models, metrics_port=0)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        watcher = server.server.watcher
        url = server.server.telemetry.metrics_url
        assert watcher is not None
        (served_dir / "model.onnx").write_bytes(b"not an onnx model")
        wait_until(lambda: watcher.refused == 1)
        assert stub.Score(request(0), timeout=5).score == pytest.approx(old, abs=1e-6)
        assert reloads(url, "refused") == 1
        assert any(
            r.levelname == "ERROR" and "do not load" in r.getMessage() for r in caplog.records
        )
        replace_files(fixed, served_dir)  # fixed files: served at the next scan
        wait_until(lambda: watcher.reloads == 1)
        assert stub.Score(request(0), timeout=5).score == pytest.approx(new, abs=1e-6)
        assert reloads(url, "replaced") == 1
    assert watcher.refused == 1


VARIANTS = ("model.fp16.onnx", "model.int8.onnx")
FP32_ENGINE = "onnxruntime-cpu"


def one_of(score: float, scores: set[float]) -> bool:
    return any(score == pytest.approx(s, abs=1e-6) for s in scores)


def engine_names(stub: pb_grpc.RiskScoringStub) -> set[str]:
    return {e.name for e in stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5).engines}


def test_model_replaced_in_place_never_answers_from_its_old_variants(tmp_path, caplog):
    """`model.onnx` replaced under traffic beside FP16/INT8 variants made from the old weights:
    from the reload on the variants are refused with one WARNING, and no reply carries an old
    weights' score; once the check runs again, variants load beside the new weights."""
    models = tmp_path / "models"
    served_dir = write_tabular_model(models, version="1", seed=0)
    add_validated_variants(served_dir)
    staged = write_tabular_model(tmp_path / "staged", version="1", seed=5)
    features = [0.2 * j for j in range(5)]
    old = {direct_score(served_dir, features, f) for f in ("model.onnx", *VARIANTS)}
    new = direct_score(staged, features)
    assert min(abs(score - new) for score in old) > 0.1
    server = reload_server(models, reload_drain_s=2, onnx_variants=True)

    def refusals() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "engines.validation" and r.levelname == "WARNING"
        ]

    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        watcher = server.server.watcher
        assert watcher is not None
        assert engine_names(stub) == {FP32_ENGINE, f"{FP32_ENGINE}-fp16", f"{FP32_ENGINE}-int8"}
        with scoring_traffic(stub, request(0)) as (replies, failures):
            wait_until(lambda: len(replies) > 50)
            # The new weights land in one step, as a deploy script's rename would.
            shutil.copyfile(staged / "model.onnx", tmp_path / "model.onnx")
            os.replace(tmp_path / "model.onnx", served_dir / "model.onnx")
            wait_until(lambda: watcher.reloads == 1)  # swapped in, the old instance drained
            seen = len(replies)
            wait_until(lambda: len(replies) > seen + 50)
        after_reload = engine_names(stub)
        warnings = refusals()

        # `riskserve validate` run again (here on variants made from the new weights, staged
        # and moved in, the report last): the variants serve again.
        add_validated_variants(staged)
        for name in (*VARIANTS, "validation.json"):
            os.replace(staged / name, served_dir / name)
        wait_until(lambda: len(engine_names(stub)) == 3)
        refreshed = stub.Score(request(0), timeout=5)

    assert failures == []
    assert watcher.refused == 0
    assert one_of(replies[0].score, old)
    for reply in replies:  # every score is one an old file or the new model.onnx gives
        assert one_of(reply.score, {*old, new}), reply
    # Past the one reply each client may still have had on its way back when the reload was
    # reported, every reply has the new weights, from FP32: the old variants are not loaded.
    for reply in replies[seen + CLIENTS :]:
        assert (reply.score, reply.engine) == (pytest.approx(new, abs=1e-6), FP32_ENGINE)
    assert after_reload == {FP32_ENGINE}
    (warning,) = warnings
    assert str(served_dir / "validation.json") in warning
    assert all(name in warning for name in VARIANTS)
    assert "model.onnx has changed since the report was made" in warning
    assert f"riskserve validate {served_dir}" in warning
    assert refreshed.score == pytest.approx(new, abs=0.05)


def test_new_version_with_a_manifest_value_that_cannot_work_is_refused(tmp_path, caplog):
    """A NaN baseline would leave every explained request without reasons: the version is
    refused at load, the log names the entry, and the version before serves on."""
    models = tmp_path / "models"
    write_tabular_model(models, version="1", seed=0)
    staged = write_tabular_model(tmp_path / "staging", version="2", seed=1)
    manifest = json.loads((staged / "manifest.json").read_text())
    manifest["explanations"] = {
        "features": {"f3": {"baseline": float("nan"), "code": "F3", "text": "f3 is high"}}
    }
    (staged / "manifest.json").write_text(json.dumps(manifest))
    server = reload_server(models)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        watcher = server.server.watcher
        assert watcher is not None
        shutil.copytree(staged, models / "credit-lite" / "2")
        wait_until(lambda: watcher.refused == 1)
        reply = stub.Score(request(0), timeout=5)
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5)
    assert reply.model_version == "1"
    assert list(info.versions) == ["1"]
    (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert str(models / "credit-lite" / "2") in error.getMessage()
    assert error.exc_info is None  # one line; the traceback is logged at DEBUG
    assert "explanations.features['f3'].baseline: nan is not a finite number" in (
        error.getMessage()
    )


def _explained_model(root: Path, seed: int) -> Path:
    """credit-lite/1 whose every score declines, with reason codes for its features."""
    folder = write_tabular_model(root, version="1", seed=seed)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["thresholds"] = {"review": 0.0, "decline": 0.0}
    manifest["explanations"] = {
        "features": {f"f{i}": {"baseline": 0.0, "code": f"C{i}", "text": f"t{i}"} for i in range(5)}
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_a_reload_lets_explained_requests_in_flight_finish(tmp_path):
    """An explained request submits its row, then the rows that explain it: a reload retiring
    its version between the two lets it finish, so none fails."""
    served_dir = _explained_model(tmp_path / "models", seed=0)
    others = [_explained_model(tmp_path / f"v{seed}", seed=seed) for seed in (1, 2)]
    explained = request(0)
    explained.explain_top_k = 2
    explained.explain_when = pb.EXPLAIN_ADVERSE
    server = reload_server(tmp_path / "models", reload_interval_s=0, reload_drain_s=5)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        watcher = server.server.watcher
        assert watcher is not None
        with scoring_traffic(stub, explained) as (replies, failures):
            for source in [*others, *others]:
                seen = len(replies)
                wait_until(lambda seen=seen: len(replies) > seen + 20)
                replace_files(source, served_dir)
                assert server.call(watcher.scan(settle=True)) == ["credit-lite/1"]
    assert failures == []
    assert replies and all(r.reasons for r in replies)
