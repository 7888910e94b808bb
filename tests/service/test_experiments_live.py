"""Champion and challenger on a live server: shadow copies, durable logs, A/B switch, report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import onnxruntime as ort
import pyarrow.parquet as pq
import pytest
from liveserver import LiveServer, server_process
from modelkit import sequence_request, write_sequence_model
from scrape import scraped_total
from waiting import wait_until

from riskreport import build_report, render_summary
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.shadow import NoRecords, read_records
from service.shadow import runner as runner_module
from service.shadow.log import read_spool
from service.shadow.runner import sampled


def request(i: int) -> pb.ScoreRequest:
    return sequence_request(i, 40)


def direct(model_dir, req: pb.ScoreRequest) -> float:
    session = ort.InferenceSession(
        str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    feed = {
        "features": np.array([[req.features[f"x{j}"] for j in range(4)]], np.float32),
        "history": np.array([[row.values for row in req.history]], np.float32),
        "history_mask": np.ones((1, len(req.history)), np.float32),
    }
    return float(session.run(["score"], feed)[0].reshape(-1)[0])


@pytest.fixture()
def setup(tmp_path):
    models = tmp_path / "models"
    v1 = write_sequence_model(models, version="1", seed=1)
    v2 = write_sequence_model(models, version="2", seed=2)
    config = tmp_path / "experiments.json"
    config.write_text(
        json.dumps(
            {"models": {"seq-mini": {"champion": "1", "challengers": ["2"], "mode": "shadow"}}}
        )
    )
    return models, v1, v2, config, tmp_path / "logs"


def shadow_env(config, logs, *, flush_interval_s: float) -> dict[str, str]:
    """A server process's settings for the seq-mini experiment."""
    return {
        "RISKSERVE_EXPERIMENTS_FILE": str(config),
        "RISKSERVE_SHADOW_LOG_PREFIX": str(logs),
        "RISKSERVE_SHADOW_FLUSH_INTERVAL_S": str(flush_interval_s),
        # Every copy is scored or dropped and counted: never sampled out, however busy the CI.
        "RISKSERVE_SHADOW_MIN_SAMPLED_SHARE": "1",
        "RISKSERVE_DEFAULT_MODEL": "seq-mini",
        "RISKSERVE_BUDGET_MS": "1000",
    }


def test_shadow_log_holds_one_record_per_accepted_request(setup, tmp_path):
    models, _, v2, config, logs = setup
    env = shadow_env(config, logs, flush_interval_s=0.2)
    served: dict[str, pb.ScoreResponse] = {}
    output: list[str] = []
    with server_process(models, output=output, **env) as (proc, target):
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.RiskScoringStub(channel)
            for i in range(120):
                reply = stub.Score(request(i), timeout=5)
                served[reply.request_id] = reply
            assert {r.model_version for r in served.values()} == {"1"}  # shadow never serves

            # Switch the experiment to A/B at run time: half the entities go to version 2.
            config.write_text(
                json.dumps(
                    {
                        "models": {
                            "seq-mini": {
                                "champion": "1",
                                "challengers": ["2"],
                                "mode": "ab",
                                "ab_share": 0.5,
                            }
                        }
                    }
                )
            )
            # A later mtime whatever the filesystem's resolution; the watcher logs the switch.
            stamp = config.stat().st_mtime + 5
            os.utime(config, (stamp, stamp))
            wait_until(lambda: any("experiments reloaded" in line for line in output))
            arms: dict[str, set[str]] = {}
            for i in range(120, 280):
                reply = stub.Score(request(i), timeout=5)
                served[reply.request_id] = reply
                arms.setdefault(request(i).entity_id, set()).add(reply.model_version)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0

    assert all(len(versions) == 1 for versions in arms.values()), "A/B split is not sticky"
    assert {v for versions in arms.values() for v in versions} == {"1", "2"}

    table = read_records(str(logs)).drop_columns(["time"]).to_pylist()
    served_rows = [r for r in table if r["served"]]
    assert sorted(r["request_id"] for r in served_rows) == sorted(served)  # one each, none lost
    for record in served_rows:
        reply = served[record["request_id"]]
        assert record["version"] == reply.model_version
        assert record["score"] == pytest.approx(reply.score, abs=1e-6)
    shadows = [r for r in table if not r["served"]]
    # Challenger records come from the shadow worker process: a replica of their own.
    (server_replica,) = {r["replica_id"] for r in served_rows}
    assert {r["replica_id"] for r in shadows} == {f"{server_replica}-shadow"}
    shadowed = {f"q{i}" for i in range(120)}
    assert sorted(r["request_id"] for r in shadows) == sorted(shadowed)
    for record in shadows[:10]:
        i = int(record["request_id"][1:])
        assert record["version"] == "2"
        assert record["score"] == pytest.approx(direct(v2, request(i)), abs=1e-5)

    out_json, out_html = tmp_path / "report.json", tmp_path / "report.html"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "service",
            "shadow-report",
            "--prefix",
            str(logs),
            "--json",
            str(out_json),
            "--html",
            str(out_html),
            "--bootstrap",
            "50",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out_json.read_text())
    assert "<img" in out_html.read_text() or "<svg" in out_html.read_text()
    assert json.dumps(report)  # parsed and re-serialisable


def live_shadow_server(models, config, logs, **settings) -> LiveServer:
    return LiveServer(
        models_dir=models,
        experiments_file=config,
        shadow_log_prefix=str(logs),
        shadow_flush_interval_s=0.1,
        # Every copy is scored or dropped and counted: never sampled out, however busy the CI.
        shadow_min_sampled_share=1.0,
        default_model="seq-mini",
        budget_ms=5000,
        **settings,
    )


def challenger_ids(logs) -> list[str]:
    # The log creates its folder before its first file lands: until then there is nothing.
    try:
        table = read_records(str(logs)).select(["request_id", "served"]).to_pylist()
    except NoRecords:
        return []
    return [r["request_id"] for r in table if not r["served"]]


def spooled_rows(logs) -> int:
    """Records appended to open log files (the next writer publishes a killed one's)."""
    return sum(read_spool(p).num_rows for p in logs.rglob("*.arrows"))


def scraped_drops(url: str) -> float:
    return scraped_total(url, "riskserve_shadow_drops_total", model="seq-mini")


def test_full_shadow_queue_drops_copies_and_counts_each_one(setup):
    models, _, _, config, logs = setup
    with live_shadow_server(models, config, logs, shadow_max_queued_jobs=1, metrics_port=0) as live:
        runner = live.server.experiments.runner
        with live.channel() as channel, ThreadPoolExecutor(16) as pool:
            stub = pb_grpc.RiskScoringStub(channel)
            replies = list(pool.map(lambda i: stub.Score(request(i), timeout=10), range(200)))
        assert {r.model_version for r in replies} == {"1"}
        assert runner.dropped > 0
        wait_until(lambda: scraped_drops(live.server.telemetry.metrics_url) >= runner.dropped)
        assert scraped_drops(live.server.telemetry.metrics_url) == runner.dropped
    # Every copy was scored and logged by the worker, or dropped and counted: none lost.
    assert runner.submitted + runner.dropped == 200
    assert len(challenger_ids(logs)) == runner.completed == runner.submitted


def test_champion_serves_on_while_the_shadow_worker_dies_and_is_replaced(setup):
    models, _, _, config, logs = setup
    with live_shadow_server(models, config, logs) as live:
        experiments = live.server.experiments
        runner = experiments.runner
        with live.channel() as channel:
            stub = pb_grpc.RiskScoringStub(channel)
            for i in range(20):
                stub.Score(request(i), timeout=5)
            wait_until(lambda: spooled_rows(logs) >= 20)  # on disk: a kill -9 cannot take them
            first = runner.worker_pid
            os.kill(first, signal.SIGKILL)
            for i in range(20, 60):  # while the worker is dead and being replaced
                assert stub.Score(request(i), timeout=5).model_version == "1"
            wait_until(lambda: runner.worker_pid not in (None, first) and not runner.full)
            for i in range(60, 80):
                assert stub.Score(request(i), timeout=5).model_version == "1"
    logged = challenger_ids(logs)
    assert runner.worker_exits == 1
    assert {f"q{i}" for i in range(60, 80)} <= set(logged)
    assert len(logged) + runner.dropped == 80 and len(set(logged)) == len(logged)


def test_a_sampled_share_shadows_exactly_the_entities_its_hash_picks(setup, monkeypatch):
    models, _, _, config, logs = setup
    monkeypatch.setattr(runner_module, "SHARE_UP_S", 3600.0)  # the share holds for the test
    with live_shadow_server(models, config, logs, metrics_port=0) as live:
        runner = live.server.experiments.runner
        runner.sampled_share = 0.25  # where a worker that fell behind leaves it
        url = live.server.telemetry.metrics_url
        assert scraped_total(url, "riskserve_shadow_sampled_share") == 0.25
        with live.channel() as channel:
            stub = pb_grpc.RiskScoringStub(channel)
            requests = [request(i) for i in range(200)]
            for req in requests:
                stub.Score(req, timeout=5)
            batch = pb.ScoreBatchRequest(requests=[request(i) for i in range(200, 240)])
            stub.ScoreBatch(batch, timeout=5)
            requests += list(batch.requests)
    picked = {
        r.request_id for r in requests if sampled(0.25, "seq-mini", r.entity_id, r.request_id)
    }
    assert 0 < len(picked) < len(requests)
    assert sorted(challenger_ids(logs)) == sorted(picked)  # by entity: each entity all or none
    assert runner.dropped == 0  # sampled out is not dropped


def published_rows(logs) -> int:
    return sum(pq.read_metadata(p).num_rows for p in logs.rglob("*.parquet"))


def test_a_report_made_while_the_server_runs_reads_its_open_files_and_sigusr1_rolls_them(setup):
    models, _, _, config, logs = setup
    env = shadow_env(config, logs, flush_interval_s=0.1)
    output: list[str] = []
    with server_process(models, output=output, **env) as (proc, target):
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.RiskScoringStub(channel)
            for i in range(30):
                stub.Score(request(i), timeout=5)
        # Both arms' records are in open files (rolled only after five minutes): read there.
        wait_until(lambda: spooled_rows(logs) == 60)
        assert published_rows(logs) == 0
        report = build_report(str(logs))
        assert (report.records, report.spooled_records) == (60, 60)
        assert report.comparisons[0].pairs == 30
        assert "60 of them from open log files not yet rolled" in render_summary(report)
        proc.send_signal(signal.SIGUSR1)  # roll now: the server's file and its worker's
        wait_until(lambda: published_rows(logs) == 60)
        assert any("rolling the experiment log files" in line for line in output)
        assert build_report(str(logs)).records == 60  # each record once, rolled or not
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
