"""Each worker's call limit in the front, sized from what the worker finishes: the arithmetic,
then `riskserve serve` for real, its limit rising under calls and falling back when they stop."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from liveserver import server_process
from modelkit import sequence_request, write_sequence_model
from scrape import scraped_total
from waiting import wait_until

from bench.servers import free_port
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.config import Settings
from service.front import find_haproxy, haproxy_config
from service.front_limits import (
    DEFAULT_WORKER_CALLS,
    WorkerLimits,
    target_s,
    worker_calls,
)

needs_haproxy = pytest.mark.skipif(
    find_haproxy() is None,
    reason="no haproxy here: `make test` installs Debian's haproxy where apt-get runs as root",
)


def test_a_worker_holds_what_it_finishes_within_the_budget_less_the_queue():
    settings = Settings(budget_ms=10)
    assert target_s(settings) == pytest.approx(0.006)  # 8 ms usable, less 2 ms of queue
    limits = WorkerLimits.for_settings(settings, Path("/x/haproxy.sock"))
    assert limits is not None
    assert (limits.floor, limits.ceiling) == (DEFAULT_WORKER_CALLS, 20)
    assert limits.limit(0) == DEFAULT_WORKER_CALLS  # idle: what a shared core takes
    assert limits.limit(1_000) == DEFAULT_WORKER_CALLS  # 6 calls in 6 ms: the floor
    assert limits.limit(2_800) == 17  # a core of its own: 16.8 calls in 6 ms
    assert limits.limit(50_000) == 20  # never more than the worker admits itself
    assert limits.changes([("worker1", 2_800), ("worker2", 100)]) == {"worker1": 17}
    limits.limits["worker1"] = 17
    assert limits.changes([("worker1", 2_820), ("worker2", 100)]) == {}
    assert limits.changes([("worker1", 10)]) == {"worker1": DEFAULT_WORKER_CALLS}


def test_a_set_limit_is_every_worker_s_and_is_not_sized():
    settings = Settings(budget_ms=10, max_requests_in_progress=3)
    assert worker_calls(settings) == (3, 3)
    assert WorkerLimits.for_settings(settings, Path("/x/haproxy.sock")) is None
    text = haproxy_config(settings, ["127.0.0.1:7001"], Path("/x/busy.http"))
    assert "maxconn 3 check" in text and "stats socket" not in text


def test_the_runtime_api_is_written_only_where_riskserve_sizes_the_limits():
    text = haproxy_config(
        Settings(), ["127.0.0.1:7001"], Path("/x/busy.http"), admin_socket=Path("/x/h.sock")
    )
    assert "\n    stats socket /x/h.sock mode 600 level admin\n" in text
    assert f"maxconn {DEFAULT_WORKER_CALLS} check" in text


def _limit(metrics_port: int) -> float:
    return scraped_total(
        f"http://127.0.0.1:{metrics_port}/metrics",
        "haproxy_server_limit_sessions",
        proxy="calls",
        server="worker1",
    )


@needs_haproxy
def test_serve_raises_a_worker_s_limit_with_what_it_finishes_and_lowers_it_after(tmp_path: Path):
    models = tmp_path / "models"
    write_sequence_model(models)
    metrics_port = free_port()
    with server_process(
        models,
        RISKSERVE_FRONT="haproxy",
        RISKSERVE_PORT=str(free_port()),
        RISKSERVE_METRICS_PORT="none",
        RISKSERVE_FRONT_METRICS_PORT=str(metrics_port),
        RISKSERVE_DEFAULT_MODEL="seq-mini",
        RISKSERVE_BUDGET_MS="2000",  # 1.1 s a worker may take: 8 calls at 8 a second
    ) as (_, target):
        assert _limit(metrics_port) == DEFAULT_WORKER_CALLS
        done = threading.Event()
        answered: list[str] = []

        def call() -> None:
            with grpc.insecure_channel(target) as channel:
                stub = pb_grpc.RiskScoringStub(channel)
                i = 0
                while not done.is_set():
                    answered.append(stub.Score(sequence_request(i, 5), timeout=5).request_id)
                    i += 1

        callers = [threading.Thread(target=call) for _ in range(2)]
        for caller in callers:
            caller.start()
        try:
            wait_until(lambda: _limit(metrics_port) > 4 * DEFAULT_WORKER_CALLS)
        finally:
            done.set()
            for caller in callers:
                caller.join()
        assert answered
        wait_until(lambda: _limit(metrics_port) == DEFAULT_WORKER_CALLS)
