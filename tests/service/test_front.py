"""The HAProxy front from `riskserve front-config`, run for real before two live servers: one
client connection's calls reach both, and calls beyond what they take are shed by the front
with RESOURCE_EXHAUSTED and its message, health and all."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from liveserver import LiveServer
from modelkit import sequence_request, write_sequence_model
from scrape import scraped_total
from waiting import port_open, wait_until

from bench.servers import free_port
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.config import Settings
from service.front import BUSY_MESSAGE, haproxy_config, queue_timeout_ms

HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
needs_haproxy = pytest.mark.skipif(
    HAPROXY is None,
    reason="no haproxy here: `make test` installs Debian's haproxy where apt-get runs as root",
)


def test_the_config_holds_each_worker_to_its_calls_and_sheds_after_a_third_of_the_budget():
    settings = Settings(port=6051, budget_ms=10, max_requests_in_progress=4)
    text = haproxy_config(settings, ["127.0.0.1:7001", "127.0.0.1:7002"], Path("/x/busy.http"))
    assert "bind 127.0.0.1:6051 proto h2" in text
    assert "server worker1 127.0.0.1:7001 proto h2 maxconn 4" in text
    assert "server worker2 127.0.0.1:7002 proto h2 maxconn 4" in text
    assert (
        f"timeout queue {queue_timeout_ms(settings)}ms" in text and queue_timeout_ms(settings) == 3
    )
    assert "errorfile 503 /x/busy.http" in text and "balance leastconn" in text
    with pytest.raises(ValueError):
        haproxy_config(settings, [], Path("busy.http"))


@pytest.fixture()
def front(tmp_path: Path) -> Iterator[tuple[str, list[LiveServer]]]:
    models = tmp_path / "models"
    write_sequence_model(models)
    workers = [
        LiveServer(models_dir=models, default_model="seq-mini", metrics_port=0, budget_ms=2000)
        for _ in range(2)
    ]
    for worker in workers:
        worker.__enter__()
    port = free_port()
    out = tmp_path / "front"
    command = [
        sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())",
        "front-config", "--out", str(out), "--workers", ",".join(w.target for w in workers),
    ]  # fmt: skip
    env = {"RISKSERVE_PORT": str(port), "RISKSERVE_MAX_REQUESTS_IN_PROGRESS": "1"}
    written = subprocess.run(
        command, capture_output=True, text=True, check=True, env={**_base_env(), **env}
    )
    assert written.stdout.strip() == str(out / "haproxy.cfg")
    assert HAPROXY is not None
    log = tmp_path / "haproxy.log"
    with log.open("wb") as sink:
        proxy = subprocess.Popen([HAPROXY, "-f", str(out / "haproxy.cfg")], stderr=sink)
    try:
        wait_until(lambda: port_open(port) or proxy.poll() is not None)
        assert proxy.poll() is None, log.read_text()
        yield f"127.0.0.1:{port}", workers
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        for worker in workers:
            worker.__exit__(None, None, None)


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RISKSERVE_")}


def _answered(worker: LiveServer) -> float:
    assert worker.server is not None
    return scraped_total(
        worker.server.telemetry.metrics_url, "riskserve_requests_total", method="Score"
    )


@needs_haproxy
def test_one_connection_s_calls_reach_both_workers_and_the_excess_is_shed(front):
    target, workers = front
    outcomes: list[str] = []
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.RiskScoringStub(channel)
        for i in range(200):  # one call at a time: each worker takes its share
            assert stub.Score(sequence_request(i, 50), timeout=5).request_id == f"q{i}"
        shares = [_answered(w) for w in workers]
        assert sum(shares) == 200 and all(80 <= s <= 120 for s in shares), shares

        def call(i: int) -> None:  # 48 at a time against two workers taking one each
            try:
                stub.Score(sequence_request(i, 50), timeout=5)
                outcomes.append("OK")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert exc.details() == BUSY_MESSAGE
                outcomes.append("shed")

        with ThreadPoolExecutor(48) as pool:
            list(pool.map(call, range(1000)))
    assert outcomes.count("shed") > 0 and outcomes.count("OK") > 0
    answered = sum(_answered(w) for w in workers) - 200
    assert answered == outcomes.count("OK")  # a shed call never reached a worker
