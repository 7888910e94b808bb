"""The HAProxy front from `riskserve front-config`, run for real before two live servers: one
client connection's calls reach both, and calls beyond what they take are shed by the front
with RESOURCE_EXHAUSTED and its message, health and all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen

import grpc
import pytest
from certs import Authority
from grpc_health.v1 import health_pb2, health_pb2_grpc
from liveserver import HAPROXY, LiveServer, needs_haproxy, server_process, socket_folder
from modelkit import sequence_request, write_sequence_model
from scrape import scraped_total
from waiting import port_open, wait_until

from bench.servers import free_port
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.config import Settings
from service.front import (
    BUSY_MESSAGE,
    FrontTLS,
    front_threads,
    haproxy_config,
    queue_timeout_ms,
    write,
)


def test_the_config_holds_each_worker_to_its_calls_and_sheds_after_a_quarter_of_the_budget():
    settings = Settings(port=6051, budget_ms=10, max_requests_in_progress=4)
    text = haproxy_config(settings, ["127.0.0.1:7001", "127.0.0.1:7002"], Path("/x/busy.http"))
    assert "bind 127.0.0.1:6051 proto h2" in text
    assert "server worker1 127.0.0.1:7001 proto h2 maxconn 4" in text
    assert "server worker2 127.0.0.1:7002 proto h2 maxconn 4" in text
    assert (
        f"timeout queue {queue_timeout_ms(settings)}ms" in text and queue_timeout_ms(settings) == 2
    )
    assert "errorfile 503 /x/busy.http" in text and "balance leastconn" in text
    with pytest.raises(ValueError):
        haproxy_config(settings, [], Path("busy.http"))


def test_the_front_runs_a_thread_for_each_eight_workers():
    settings = Settings(port=6051)
    for workers, threads in ((1, 1), (2, 1), (8, 1), (9, 2), (32, 4)):
        addresses = [f"127.0.0.1:{7001 + i}" for i in range(workers)]
        text = haproxy_config(settings, addresses, Path("/x/busy.http"))
        assert front_threads(workers) == threads
        assert f"\n    nbthread {threads}\n" in text, (workers, text.splitlines()[:4])


@pytest.fixture()
def models(tmp_path: Path) -> Path:
    """A models folder with the small sequence model, `seq-mini`."""
    write_sequence_model(tmp_path / "models")
    return tmp_path / "models"


@pytest.fixture()
def front(models: Path, tmp_path: Path) -> Iterator[tuple[str, list[LiveServer]]]:
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


def _score_or_shed(stub: pb_grpc.RiskScoringStub, i: int, outcomes: list[str]) -> None:
    """One Score call: answered, or refused by the front with its message."""
    try:
        stub.Score(sequence_request(i, 50), timeout=5)
        outcomes.append("OK")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        assert exc.details() == BUSY_MESSAGE
        outcomes.append("shed")


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

        with ThreadPoolExecutor(48) as pool:  # against two workers taking one call each
            list(pool.map(lambda i: _score_or_shed(stub, i, outcomes), range(1000)))
    assert outcomes.count("shed") > 0 and outcomes.count("OK") > 0
    answered = sum(_answered(w) for w in workers) - 200
    assert answered == outcomes.count("OK")  # a shed call never reached a worker


def test_the_front_needs_a_fixed_port_and_leaves_client_names_to_a_lone_server():
    with pytest.raises(ValueError, match="fixed port"):
        Settings(front="haproxy", port=0)
    with pytest.raises(ValueError, match="auth_client_names"):
        Settings(front="auto", port=6051, auth_client_names=("decisions",))
    settings = Settings(front="haproxy", port=6051, metrics_port=9464, processes=2)
    assert settings.front_metrics_port_resolved == 9466  # after the workers' 9464 and 9465
    assert (
        Settings(front="haproxy", port=6051, metrics_port=None).front_metrics_port_resolved is None
    )


@needs_haproxy
def test_haproxy_accepts_the_written_config_with_tls_and_metrics(tmp_path: Path):
    authority = Authority()
    pair = authority.issue("127.0.0.1", server=True)
    (tmp_path / "front.pem").write_bytes(pair.cert_pem + pair.key_pem)
    (tmp_path / "ca.pem").write_bytes(authority.pem)
    tls = FrontTLS(tmp_path / "front.pem", tmp_path / "ca.pem")
    config = write(
        tmp_path, Settings(port=free_port()), ["/run/w0.sock", "127.0.0.1:7002"],
        metrics_port=free_port(), tls=tls,
    )  # fmt: skip
    checked = subprocess.run([str(HAPROXY), "-c", "-f", str(config)], capture_output=True)
    assert checked.returncode == 0, checked.stderr.decode()
    text = config.read_text()
    assert "server worker1 unix@/run/w0.sock proto h2 maxconn 8" in text
    assert f"ssl crt {tmp_path / 'front.pem'} alpn h2 ca-file {tmp_path / 'ca.pem'}" in text


@needs_haproxy
def test_front_config_writes_the_settings_tls_and_the_fronts_metrics(tmp_path: Path):
    """`riskserve front-config` writes what `serve` runs: with a certificate set, a TLS port,
    never plaintext; and the front's metrics endpoint where it is on."""
    authority = Authority()
    pair = authority.issue("127.0.0.1", server=True)
    (tmp_path / "tls.crt").write_bytes(pair.cert_pem)
    (tmp_path / "tls.key").write_bytes(pair.key_pem)
    metrics_port = free_port()
    env = {
        "RISKSERVE_HOST": "0.0.0.0",
        "RISKSERVE_PORT": str(free_port()),
        "RISKSERVE_TLS_CERT_FILE": str(tmp_path / "tls.crt"),
        "RISKSERVE_TLS_KEY_FILE": str(tmp_path / "tls.key"),
        "RISKSERVE_FRONT_METRICS_PORT": str(metrics_port),
    }
    command = [
        sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())",
        "front-config", "--out", "front", "--workers", "127.0.0.1:7001",
    ]  # fmt: skip
    subprocess.run(command, cwd=tmp_path, check=True, env={**_base_env(), **env})
    config = tmp_path / "front" / "haproxy.cfg"
    text = config.read_text()
    assert f"ssl crt {tmp_path / 'front' / 'front.pem'} alpn h2" in text
    assert f"bind 127.0.0.1:{metrics_port}" in text
    checked = subprocess.run([str(HAPROXY), "-c", "-f", str(config)], capture_output=True)
    assert checked.returncode == 0, checked.stderr.decode()


def test_an_ipv6_host_is_bracketed_once_and_an_empty_one_needs_tls():
    """`[::1]` and `::1` are one address to HAProxy's bind; an empty host is every interface,
    so it is no loopback that plaintext may serve."""
    for host in ("::1", "[::1]"):
        text = haproxy_config(Settings(host=host, port=6051), ["127.0.0.1:7001"], Path("/x/b"))
        assert "\n    bind [::1]:6051 proto h2\n" in text
    with pytest.raises(ValueError, match="plaintext"):
        Settings(host="", port=6051)


@contextmanager
def _served(models: Path, output: list[str], **env: str) -> Iterator[tuple[Popen, str, int]]:
    """`riskserve serve` with the front over two workers, each taking one scoring call;
    yields the process, its target and the front's metrics port."""
    metrics_port = free_port()
    with server_process(
        models,
        output=output,
        RISKSERVE_FRONT="haproxy",
        RISKSERVE_PROCESSES="2",
        RISKSERVE_PORT=str(free_port()),
        RISKSERVE_METRICS_PORT="none",
        RISKSERVE_FRONT_METRICS_PORT=str(metrics_port),
        RISKSERVE_MAX_REQUESTS_IN_PROGRESS="1",
        RISKSERVE_DEFAULT_MODEL="seq-mini",
        **env,
    ) as (proc, target):
        yield proc, target, metrics_port


def _front_total(port: int, name: str, **labels: str) -> float:
    return scraped_total(f"http://127.0.0.1:{port}/metrics", name, **labels)


@needs_haproxy
def test_serve_spreads_one_connection_over_its_workers_and_sheds_with_health_serving(models: Path):
    with _served(models, []) as (_, target, metrics_port), grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        for i in range(200):
            assert stub.Score(sequence_request(i, 50), timeout=5).request_id == f"q{i}"
        shares = [
            _front_total(metrics_port, "haproxy_server_http_responses_total",
                         proxy="calls", server=f"worker{w}", code="2xx")
            for w in (1, 2)
        ]  # fmt: skip
        assert sum(shares) == 200 and all(80 <= s <= 120 for s in shares), shares

        outcomes: list[str] = []
        health_seen: list[int] = []
        done = threading.Event()

        def probe() -> None:  # the health service, asked while the front sheds
            check = health_pb2_grpc.HealthStub(channel).Check
            while not done.is_set():
                health_seen.append(check(health_pb2.HealthCheckRequest(), timeout=5).status)

        prober = threading.Thread(target=probe)
        with ThreadPoolExecutor(48) as pool:
            calls = pool.map(lambda i: _score_or_shed(stub, i, outcomes), range(1000))
            prober.start()
            streamed = list(stub.ScoreStream(iter(sequence_request(i, 5) for i in range(20))))
            list(calls)
        done.set()
        prober.join()
        shed = _front_total(
            metrics_port, "haproxy_backend_http_responses_total", proxy="calls", code="5xx"
        )
    assert health_seen and set(health_seen) == {health_pb2.HealthCheckResponse.SERVING}
    assert sorted(r.request_id for r in streamed) == sorted(f"q{i}" for i in range(20))
    assert outcomes.count("shed") > 0 and outcomes.count("OK") > 0
    assert shed == outcomes.count("shed")  # each refusal counted where it was made


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@needs_haproxy
def test_sigterm_drains_and_ends_the_workers_the_front_and_their_sockets(models: Path):
    output: list[str] = []
    with _served(models, output) as (proc, target, metrics_port):
        children = _children(proc.pid)
        assert len(children) == 3  # two workers and HAProxy
        folder = socket_folder(output)
        assert folder.is_dir()
        with grpc.insecure_channel(target) as channel:
            assert pb_grpc.RiskScoringStub(channel).Score(sequence_request(1, 5), timeout=5)
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert not folder.exists() and not port_open(metrics_port)
    assert not [c for c in children if Path(f"/proc/{c}").exists()]


@needs_haproxy
def test_an_idle_front_stops_without_waiting_out_its_queue_time(models: Path):
    """A stop lets the front's queue empty for twice its queue time (a quarter of the budget)
    at most: a front holding no call ends at once, however long the budget. HAProxy's hard
    stop counts that wait too."""
    settings = Settings(port=6051, budget_ms=40_000, shutdown_grace_s=1)
    config = haproxy_config(settings, ["127.0.0.1:7001"], Path("/x/b"))
    assert "\n    hard-stop-after 23s\n" in config  # 1 s of grace, 20 s of queue, 2 s
    with _served(models, [], RISKSERVE_BUDGET_MS="40000", RISKSERVE_SHUTDOWN_GRACE_S="1") as (
        proc,
        target,
        _,
    ):
        with grpc.insecure_channel(target) as channel:
            assert pb_grpc.RiskScoringStub(channel).Score(sequence_request(1, 5), timeout=5)
        proc.terminate()
        assert proc.wait(timeout=15) == 0  # the queue's 20 s are not waited out


@needs_haproxy
def test_a_worker_that_dies_stops_the_service_with_a_failure(models: Path):
    output: list[str] = []
    with _served(models, output) as (proc, _, _port):
        workers = [
            c
            for c in _children(proc.pid)
            if "haproxy" not in Path(f"/proc/{c}/cmdline").read_text()
        ]
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
    assert any("ended (exit status -9): stopping" in line for line in output)


@needs_haproxy
def test_the_front_terminates_the_settings_tls(models: Path, tmp_path: Path):
    authority = Authority()
    pair = authority.issue("127.0.0.1", server=True)
    (tmp_path / "tls.crt").write_bytes(pair.cert_pem)
    (tmp_path / "tls.key").write_bytes(pair.key_pem)
    tls = {
        "RISKSERVE_TLS_CERT_FILE": str(tmp_path / "tls.crt"),
        "RISKSERVE_TLS_KEY_FILE": str(tmp_path / "tls.key"),
    }
    with _served(models, [], **tls) as (_, target, _port):
        credentials = grpc.ssl_channel_credentials(authority.pem)
        with grpc.secure_channel(target, credentials) as channel:
            reply = pb_grpc.RiskScoringStub(channel).Score(sequence_request(3, 5), timeout=5)
            assert reply.request_id == "q3"
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.RiskScoringStub(channel).Score(sequence_request(3, 5), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def _ignores(pid: int, signum: int) -> bool:
    """Whether process `pid` ignores `signum` now (/proc's SigIgn)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    ignored = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(ignored.split()[1], 16) & (1 << (signum - 1)))


def _loading_front(models: Path, **env: str) -> tuple[Popen, list[int]]:
    """`riskserve serve` with the front over two workers whose models take a while to load
    (many warm-up runs); returned once each worker has its own signal dispositions: SIGHUP
    ignored until it serves (/proc's SigIgn), not the front's handler it was forked with."""
    environ = {
        **os.environ,
        "RISKSERVE_MODELS_DIR": str(models),
        "RISKSERVE_FRONT": "haproxy",
        "RISKSERVE_PROCESSES": "2",
        "RISKSERVE_PORT": str(free_port()),
        "RISKSERVE_METRICS_PORT": "none",
        "RISKSERVE_TRACE_FILE": "none",
        "RISKSERVE_DEFAULT_MODEL": "seq-mini",
        "RISKSERVE_WARMUP_ITERATIONS": "2000",
        **env,
    }
    proc = Popen(
        [sys.executable, "-m", "service", "serve"],
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def workers_loading() -> bool:
        workers = _children(proc.pid)
        return len(workers) == 2 and all(_ignores(w, signal.SIGHUP) for w in workers)

    wait_until(workers_loading, timeout_s=60)  # both loading, SIGHUP ignored
    return proc, _children(proc.pid)


@needs_haproxy
def test_a_reload_signal_while_the_workers_load_waits_and_the_service_comes_up(models: Path):
    proc, workers = _loading_front(models)
    try:
        proc.send_signal(signal.SIGHUP)  # forwarded to the loading workers, which ignore it
        wait_until(lambda: len(_children(proc.pid)) == 3, timeout_s=120)  # HAProxy started
        assert proc.poll() is None and all(Path(f"/proc/{w}").exists() for w in workers)
    finally:
        proc.terminate()
    assert proc.wait(timeout=60) == 0


@needs_haproxy
def test_a_front_on_a_port_in_use_says_so_and_never_that_it_listens(models: Path):
    """Something already listens on the port: the service says so in one line (exit 2) before
    its workers load, as a lone server does, and never shares the port (HAProxy binds it
    without SO_REUSEPORT)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        environ = {
            **_base_env(),
            "RISKSERVE_MODELS_DIR": str(models),
            "RISKSERVE_FRONT": "haproxy",
            "RISKSERVE_PORT": str(port),
            "RISKSERVE_METRICS_PORT": "none",
            "RISKSERVE_TRACE_FILE": "none",
            "RISKSERVE_DEFAULT_MODEL": "seq-mini",
        }
        done = subprocess.run(
            [sys.executable, "-m", "service", "serve"],
            env=environ, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "listening" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"riskserve serve: cannot listen on 127.0.0.1:{port}: the port is in use"
    )
    config = haproxy_config(Settings(port=6051), ["127.0.0.1:7001"], Path("/x/b"))
    assert "\n    noreuseport\n" in config


@needs_haproxy
def test_a_stop_while_the_workers_load_ends_them_at_once(models: Path):
    # A grace longer than the wait below: a worker that let its stop wait would outlast it.
    proc, workers = _loading_front(models, RISKSERVE_SHUTDOWN_GRACE_S="60")
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert not [w for w in workers if Path(f"/proc/{w}").exists()]


def test_a_lone_server_loading_its_models_outlives_a_reload_or_log_roll_signal(models: Path):
    """`riskserve serve` without the front: SIGHUP and SIGUSR1 while the models load (their
    default action ends a process) wait, and the server comes up."""
    environ = {
        **os.environ,
        "RISKSERVE_MODELS_DIR": str(models),
        "RISKSERVE_FRONT": "none",
        "RISKSERVE_PORT": str(free_port()),
        "RISKSERVE_METRICS_PORT": "none",
        "RISKSERVE_TRACE_FILE": "none",
        "RISKSERVE_DEFAULT_MODEL": "seq-mini",
        "RISKSERVE_WARMUP_ITERATIONS": "2000",
    }
    argv = [sys.executable, "-m", "service", "serve"]
    with Popen(
        argv, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            wait_until(lambda: _ignores(proc.pid, signal.SIGUSR1), timeout_s=60)  # loading
            proc.send_signal(signal.SIGUSR1)
            proc.send_signal(signal.SIGHUP)
            assert proc.stdout is not None
            said = (line for line in proc.stdout if line.startswith("riskserve listening on"))
            assert next(said, None) is not None  # None: the output ended, the server with it
        finally:
            proc.terminate()
            assert proc.wait(timeout=60) == 0
