"""A live riskserve exporting to a real OTLP receiver, and its Prometheus endpoint scraped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
from fakes import fake_factory
from liveserver import LiveServer
from modelkit import write_sequence_model
from waiting import wait_until

from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc


def request(i: int) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=str(i),
        features={f"x{j}": float(j) for j in range(4)},
        history=[pb.HistoryRow(values=[0.1, 0.2, 0.3])] * 3,
    )


def serve(models, engine_options: dict, **settings) -> LiveServer:
    """A live riskserve over seq-mini with a FakeEngine, generous budget, no warm-up."""
    factory, _ = fake_factory(**engine_options)
    settings.setdefault("warmup_iterations", 0)
    return LiveServer(
        engine_factory=factory,
        models_dir=models,
        default_model="seq-mini",
        budget_ms=2000,
        **settings,
    )


@pytest.fixture()
def models(tmp_path):
    write_sequence_model(tmp_path)
    return tmp_path


def test_slow_and_failed_requests_arrive_with_batch_spans(otlp_env, models):
    # Engine 30 ms against a slow threshold of 10 ms: every scored request is slow; ratio 0
    # drops everything else, so exactly the slow and the failed traces must arrive.
    server = serve(models, {"base_s": 0.03}, trace_slow_ms=10, trace_sample_ratio=0.0)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        for i in range(3):
            stub.Score(request(i), timeout=5)
        bad = request(9)
        bad.features["bogus"] = 1.0
        with pytest.raises(grpc.RpcError):
            stub.Score(bad, timeout=5)
        server.call(_noop())
    spans = otlp_env.wait_for(
        lambda s: (
            sum(x.name == "riskserve.batch" for x in s) >= 3
            and sum(x.name.endswith("/Score") for x in s) >= 4
            and sum(x.name == "riskserve.score" for x in s) >= 3
        ),
        timeout_s=10,
    )
    roots = [s for s in spans if s.name == "riskscoring.v1.RiskScoring/Score"]
    assert len(roots) == 4
    scored = [r for r in roots if r.attributes["rpc.grpc.status_code"] == 0]
    failed = [r for r in roots if r.attributes["rpc.grpc.status_code"] == 3]
    assert len(scored) == 3 and len(failed) == 1
    for root in scored:
        assert root.attributes["riskserve.model"] == "seq-mini"
        assert root.attributes["riskserve.engine"] == "fake"
        assert root.attributes["riskserve.sampled_reason"] == "slow"
        assert root.attributes["riskserve.engine_us"] >= 25_000
        assert root.attributes["rpc.system"] == "grpc"
    assert failed[0].attributes["riskserve.sampled_reason"] == "error"
    # Each scored request's stages are child spans of its server span, in order.
    for root in scored:
        stages = {s.name: s for s in spans if s.parent_span_id == root.span_id}
        assert set(stages) == {"riskserve.validate", "riskserve.queue", "riskserve.score"}
        assert all(s.trace_id == root.trace_id for s in stages.values())
        assert stages["riskserve.score"].duration_ms >= 25.0
        assert stages["riskserve.score"].attributes["riskserve.engine"] == "fake"
    # The request that failed validation has no stage past the one it failed in.
    assert not [s for s in spans if s.parent_span_id == failed[0].span_id]
    batches = [s for s in spans if s.name == "riskserve.batch"]
    linked = {link for b in batches for link in b.links}
    assert {(r.trace_id, r.span_id) for r in scored} <= linked
    assert all(b.attributes["riskserve.batch.size"] == 1 for b in batches)
    assert {b.attributes["riskserve.engine"] for b in batches} == {"fake"}


async def _noop() -> None:
    return None


def test_prometheus_endpoint_counts_requests(models):
    server = serve(models, {}, metrics_port=0)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        for i in range(7):
            stub.Score(request(i), timeout=5)
        with pytest.raises(grpc.RpcError):
            stub.Score(pb.ScoreRequest(features={"nope": 1.0}), timeout=5)
        url = server.server.telemetry.metrics_url
        pages: list[str] = []

        def scraped_the_refusal() -> bool:
            # A call is counted just after its status is sent: the last one comes a bit later.
            pages.append(urllib.request.urlopen(url, timeout=5).read().decode())
            return 'status="INVALID_ARGUMENT"' in pages[-1]

        wait_until(scraped_the_refusal)
        text = pages[-1]

    def value(pattern: str) -> float:
        match = re.search(pattern + r" ([0-9.e+]+)$", text, re.MULTILINE)
        assert match, pattern
        return float(match.group(1))

    assert value(r'riskserve_requests_total\{[^}]*status="OK"[^}]*\}') == 7
    assert value(r'riskserve_requests_total\{[^}]*status="INVALID_ARGUMENT"[^}]*\}') == 1
    assert value(r'riskserve_request_duration_seconds_count\{engine="fake"[^}]*\}') == 7
    assert value(r"riskserve_batch_size_count\{[^}]*\}") == 7
    assert value(r"riskserve_engine_duration_seconds_count\{[^}]*\}") == 7
    assert 'le="0.01"' in text  # buckets fit a 10 ms budget


def run_stats(server: LiveServer, window_s: float) -> subprocess.CompletedProcess[str]:
    """`riskserve stats` with no --url: it finds the metrics port in the server's own setting."""
    return subprocess.run(
        [sys.executable, "-m", "service", "stats", "--window-s", f"{window_s:g}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "RISKSERVE_METRICS_PORT": str(server.server.telemetry.metrics_port)},
    )


def test_stats_command_shows_live_percentiles(models):
    server = serve(models, {"base_s": 0.002}, metrics_port=0)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                stub.Score(request(1), timeout=5)

        worker = threading.Thread(target=load)
        worker.start()
        try:
            done = run_stats(server, 1)
        finally:
            stop.set()
            worker.join()
    assert done.returncode == 0, done.stderr
    assert "p99" in done.stdout


def test_stats_command_on_an_idle_server_says_no_requests(models):
    with serve(models, {}, metrics_port=0) as server:
        done = run_stats(server, 0.2)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "window 0.2 s: no requests in the window"
    assert "nan" not in done.stdout
