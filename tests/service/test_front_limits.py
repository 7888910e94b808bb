"""Each worker's call limit in the front, sized from what the worker finishes: the arithmetic,
then `riskserve serve` for real, its worker's limit rising under calls, and the statistics it
was sized from as HAProxy reports them."""

from __future__ import annotations

import csv
import logging
import socket
import subprocess
import threading
from pathlib import Path

import grpc
import pytest
from fakes import fake_factory
from liveserver import HAPROXY, LiveServer, needs_haproxy, server_process, socket_folder
from modelkit import sequence_request, write_sequence_model
from scrape import scraped_total
from waiting import port_open, wait_until

from bench.servers import free_port
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.config import Settings
from service.front import haproxy_config, write
from service.front_limits import (
    DEFAULT_WORKER_CALLS,
    Calls,
    Worker,
    WorkerLimits,
    read_refusals,
    read_stats,
    runtime_command,
    target_s,
    worker_calls,
)


def test_a_worker_holds_what_it_finishes_within_the_budget_less_the_queue():
    settings = Settings(budget_ms=10)
    assert target_s(settings) == pytest.approx(0.006)  # 8 ms usable, less 2 ms of queue
    limits = WorkerLimits.for_settings(settings, Path("/x/haproxy.sock"))
    assert limits is not None
    # 20: what the worker admits itself (8 ms at 0.4 ms a call), where each worker starts.
    assert limits.calls == Calls(DEFAULT_WORKER_CALLS, 20)
    assert limits.current("worker1") == 20
    assert limits.limit(0) == DEFAULT_WORKER_CALLS  # idle: what a shared core takes
    assert limits.limit(1_000) == DEFAULT_WORKER_CALLS  # 6 calls in 6 ms: the floor
    assert limits.limit(2_800) == 17  # a core of its own: 16.8 calls in 6 ms
    assert limits.limit(50_000) == 20  # never more than the worker admits itself
    # A full worker's limit follows what it finishes, up or down.
    assert limits.changes([("worker1", 2_800, True), ("worker2", 100, False)]) == {"worker1": 17}
    assert limits.changes([("worker2", 1_000, True)]) == {"worker2": DEFAULT_WORKER_CALLS}
    limits.limits["worker1"] = 17
    assert limits.changes([("worker1", 2_820, True)]) == {}
    assert limits.changes([("worker1", 1_000, True)]) == {"worker1": DEFAULT_WORKER_CALLS}
    # One with room to spare finishes what it is sent: its limit stays, or rises.
    assert limits.changes([("worker1", 10, False)]) == {}
    assert limits.changes([("worker1", 3_100, False)]) == {"worker1": 19}


def test_a_set_limit_is_every_worker_s_and_is_not_sized():
    settings = Settings(budget_ms=10, max_requests_in_progress=3)
    assert worker_calls(settings) == Calls(3, 3)
    assert WorkerLimits.for_settings(settings, Path("/x/haproxy.sock")) is None
    text = haproxy_config(settings, ["127.0.0.1:7001"], Path("/x/busy.http"))
    assert "maxconn 3 check" in text and "stats socket" not in text


def test_the_runtime_api_is_written_only_where_riskserve_sizes_the_limits():
    text = haproxy_config(
        Settings(), ["127.0.0.1:7001"], Path("/x/busy.http"), admin_socket=Path("/x/h.sock")
    )
    assert "\n    stats socket /x/h.sock mode 600 level admin\n" in text
    assert "maxconn 20 check" in text  # where a worker starts
    fixed = haproxy_config(Settings(), ["127.0.0.1:7001"], Path("/x/busy.http"))
    assert f"maxconn {DEFAULT_WORKER_CALLS} check" in fixed and "stats socket" not in fixed


def _limit(metrics_port: int) -> float:
    return scraped_total(
        f"http://127.0.0.1:{metrics_port}/metrics",
        "haproxy_server_limit_sessions",
        proxy="calls",
        server="worker1",
    )


def _slim(socket_path: Path) -> int:
    """The limit HAProxy holds worker1 of the calls backend to now."""
    text = runtime_command(socket_path, "show stat -1 4 -1").removeprefix("# ")
    (row,) = [r for r in csv.DictReader(text.splitlines()) if r["pxname"] == "calls"]
    return int(row["slim"])


@needs_haproxy
def test_a_full_worker_s_limit_comes_down_to_what_it_finishes(tmp_path: Path):
    """A worker that scores 200 calls a second (a 5 ms engine, one call a batch) behind a real
    HAProxy, 16 callers against its limit of 8: it is full, and its limit is brought down
    to what it finishes in the 10 ms this sizing allows, 2 (the least here is 1)."""
    models = tmp_path / "models"
    write_sequence_model(models)
    factory, _ = fake_factory(base_s=0.005)
    settings = Settings(port=free_port(), budget_ms=2000)
    admin = tmp_path / "front" / "haproxy.sock"
    with LiveServer(
        factory, models_dir=models, default_model="seq-mini", budget_ms=2000, max_batch_size=1
    ) as worker:
        config = write(tmp_path / "front", settings, [worker.target], admin_socket=admin)
        proxy = subprocess.Popen([str(HAPROXY), "-f", str(config)])
        try:
            wait_until(lambda: admin.exists() and port_open(settings.port))
            limits = WorkerLimits(admin, Calls(least=1, most=8), target_s=0.01)
            runtime_command(admin, "set maxconn server calls/worker1 8")
            done = threading.Event()
            answered: list[str] = []

            def call() -> None:
                with grpc.insecure_channel(f"127.0.0.1:{settings.port}") as channel:
                    stub = pb_grpc.RiskScoringStub(channel)
                    while not done.is_set():
                        answered.append(stub.Score(sequence_request(1, 5), timeout=5).request_id)

            callers = [threading.Thread(target=call) for _ in range(16)]
            for caller in callers:
                caller.start()
            try:
                wait_until(lambda: (limits.poll(), limits.current("worker1"))[1] <= 3)
            finally:
                done.set()
                for caller in callers:
                    caller.join()
            assert answered and _slim(admin) == limits.current("worker1")
        finally:
            proxy.terminate()
            proxy.wait(timeout=10)


@needs_haproxy
def test_serve_sizes_a_full_worker_s_limit_from_what_it_finishes(tmp_path: Path):
    """`riskserve serve` with its defaults: the worker starts at the 20 calls it admits, and 32
    callers, more than a worker on these shared cores finishes within 6 ms (that would take
    3,300 calls a second beside the callers and HAProxy), bring its limit down."""
    models = tmp_path / "models"
    write_sequence_model(models)
    metrics_port = free_port()
    output: list[str] = []
    with server_process(
        models,
        output=output,
        RISKSERVE_FRONT="haproxy",
        RISKSERVE_PORT=str(free_port()),
        RISKSERVE_METRICS_PORT="none",
        RISKSERVE_FRONT_METRICS_PORT=str(metrics_port),
        RISKSERVE_DEFAULT_MODEL="seq-mini",
    ) as (_, target):
        most = worker_calls(Settings()).most
        assert _limit(metrics_port) == most == 20
        done = threading.Event()
        outcomes: list[grpc.StatusCode] = []

        def call() -> None:
            with grpc.insecure_channel(target) as channel:
                stub = pb_grpc.RiskScoringStub(channel)
                while not done.is_set():
                    try:
                        stub.Score(sequence_request(1, 5), timeout=5)
                        outcomes.append(grpc.StatusCode.OK)
                    except grpc.RpcError as exc:
                        outcomes.append(exc.code())

        callers = [threading.Thread(target=call) for _ in range(32)]
        for caller in callers:
            caller.start()
        try:
            wait_until(lambda: _limit(metrics_port) < most)
        finally:
            done.set()
            for caller in callers:
                caller.join()
        assert grpc.StatusCode.OK in outcomes
        assert set(outcomes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 grpc.StatusCode.DEADLINE_EXCEEDED}  # fmt: skip
        # Calls the worker refuses (here as invalid) are not calls it finished.
        with grpc.insecure_channel(target) as channel:
            for _ in range(5):
                with pytest.raises(grpc.RpcError) as refused:
                    pb_grpc.RiskScoringStub(channel).Score(pb.ScoreRequest(), timeout=5)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # What the limit was sized from, as HAProxy reports it once the calls have ended.
        admin = socket_folder(output) / "haproxy.sock"
        refusals = read_refusals(runtime_command(admin, "show table calls"))
        workers, queued = read_stats(runtime_command(admin, "show stat -1 6 -1"), refusals)
        late = outcomes.count(grpc.StatusCode.DEADLINE_EXCEEDED)  # the worker's, or the caller's
        assert refusals[1] - 5 <= late
        finished = outcomes.count(grpc.StatusCode.OK) + late - (refusals[1] - 5)
        assert workers == {"worker1": Worker(finished=finished, holding=0)}
        assert queued == 0


def test_what_haproxy_answers_that_cannot_be_read_leaves_the_limits_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """A runtime API that answers nonsense (a stand-in socket: what it says is the test) never
    stops the supervising process: the limits stay, and one WARNING says why."""
    path = tmp_path / "api.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    answers = iter([b"# pxname,svname,stot,scur,qcur\ncalls,worker1,many,0,0\n"] * 3)

    def serve() -> None:
        for answer in answers:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(answer)

    server = threading.Thread(target=serve)
    server.start()
    limits = WorkerLimits(path, Calls(least=8, most=20), target_s=0.006)
    with caplog.at_level(logging.DEBUG, logger="service.front_limits"):
        for _ in range(3):
            limits.poll()
    server.join()
    listener.close()
    assert limits.limits == {} and limits.current("worker1") == 20
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreadable statistics" in warnings[0].getMessage()
