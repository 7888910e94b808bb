"""Graceful shutdown of a server process under steady load: SIGTERM turns health NOT_SERVING,
refuses new calls, lets every call already sent finish, and exits 0 within the grace period."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from liveserver import server_process
from modelkit import write_sequence_model
from waiting import wait_until

from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

GRACE_S = 3.0
CLIENTS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("shutdown")
    write_sequence_model(root)
    return root


def request(i: int) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=str(i),
        features={f"x{j}": 0.1 * j for j in range(4)},
        history=[pb.HistoryRow(values=[0.5, 1.0, -1.0])] * 4,
    )


class Load:
    """Clients calling Score back to back; each call recorded with its start time and outcome."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.RiskScoringStub(self.channel)
        self.stop = threading.Event()
        self.calls: list[tuple[float, grpc.StatusCode]] = []
        self.answered = [0] * CLIENTS  # each client's OK calls
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(k,)) for k in range(CLIENTS)]

    def _client(self, k: int) -> None:
        i = 0
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.stub.Score(request(k * 100_000 + i), timeout=10)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            with self._lock:
                self.calls.append((started, code))
                self.answered[k] += code == grpc.StatusCode.OK
            i += 1
            if code != grpc.StatusCode.OK:
                time.sleep(0.01)  # a refused client backs off, as a real one would

    def answered_clients(self) -> int:
        with self._lock:
            return sum(1 for n in self.answered if n >= 2)

    def codes_since(self, moment: float) -> list[grpc.StatusCode]:
        with self._lock:
            return [code for started, code in self.calls if started >= moment]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=20)
        self.channel.close()


def watch_health(target: str, seen: list[int]) -> threading.Thread:
    def run() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                for reply in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30):
                    seen.append(reply.status)
            except grpc.RpcError:
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_sigterm_drains_under_load(models):
    env = {
        "RISKSERVE_DEFAULT_MODEL": "seq-mini",
        "RISKSERVE_SHUTDOWN_GRACE_S": str(GRACE_S),
        "RISKSERVE_BUDGET_MS": "5000",
        # Requests wait in the queue for a fuller batch, so work is queued when SIGTERM lands.
        "RISKSERVE_MAX_QUEUE_DELAY_US": "20000",
    }
    with server_process(models, **env) as (proc, target):
        seen: list[int] = []
        watcher = watch_health(target, seen)
        wait_until(lambda: bool(seen))
        assert seen == [health_pb2.HealthCheckResponse.SERVING]
        with Load(target) as load:
            # Every client has had answers, so each has a call on its way when SIGTERM lands.
            wait_until(lambda: load.answered_clients() == CLIENTS)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: health_pb2.HealthCheckResponse.NOT_SERVING in seen)
            # The hang guard only: a grace period that ran out would cancel calls sent before
            # the signal, which the checks below refuse.
            code = proc.wait(timeout=GRACE_S + 30)
            wait_until(lambda: grpc.StatusCode.UNAVAILABLE in load.codes_since(signalled))
        watcher.join(timeout=5)
        # A new call after the stop is refused.
        with grpc.insecure_channel(target) as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.RiskScoringStub(channel).Score(request(0), timeout=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    assert code == 0
    sent_before = [c for started, c in load.calls if started < signalled]
    after = [c for started, c in load.calls if started >= signalled]
    # Everything sent before the signal finished OK: none lost.
    assert set(sent_before) == {grpc.StatusCode.OK}
    # A call that reaches the server at the instant its listener closes can end CANCELLED
    # before any handler ran (a race inside gRPC); it was sent after NOT_SERVING was announced.
    assert set(after) <= {
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
    }
    assert after.count(grpc.StatusCode.CANCELLED) <= CLIENTS
    assert grpc.StatusCode.UNAVAILABLE in after
    print(f"shutdown: {len(sent_before)} calls before SIGTERM")


@contextmanager
def _two_processes(models) -> Iterator[subprocess.Popen[str]]:
    """`riskserve serve` with RISKSERVE_PROCESSES=2 and no front, once both listen."""
    with socket.socket() as probe:  # processes share one port, which must be fixed
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    output: list[str] = []
    with server_process(
        models, output=output, RISKSERVE_PROCESSES="2", RISKSERVE_FRONT="none", RISKSERVE_PORT=port
    ) as (proc, _):
        # Each says so in a line of its own.
        wait_until(
            lambda: sum(line.startswith("riskserve listening on ") for line in output) == 2, 120
        )
        yield proc


def test_a_worker_killed_by_a_signal_makes_the_service_exit_with_it(models):
    """`RISKSERVE_PROCESSES` without the front: a worker ended by a signal (the OOM killer, a
    crash) is no clean stop, and the service's exit status says so as a shell would (128 + 9)."""
    with _two_processes(models) as proc:
        killed, _ = psutil.Process(proc.pid).children()
        killed.send_signal(signal.SIGKILL)
        # No wait for it to go: the service reaps its workers in order, so one killed while
        # it waits on the other stays a zombie until then.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGKILL


def test_workers_end_when_the_service_is_killed_outright(models):
    """`RISKSERVE_PROCESSES` without the front: the service killed with SIGKILL (nothing it can
    forward) takes its workers with it, as the kernel tells each its parent ended; they kept
    serving on the shared port."""
    with _two_processes(models) as proc:
        workers = psutil.Process(proc.pid).children()
        proc.kill()
        proc.wait(30)
        gone, alive = psutil.wait_procs(workers, timeout=30)
    assert alive == [] and len(gone) == 2
