"""The front: HAProxy before the server processes, configured from the settings.

A gRPC server in Python pays for a call it refuses about what it pays for one it answers, and
calls beyond what it can finish wait in gRPC's core, unseen, until their callers give up. A
front in C holds each worker to a few calls at a time (`maxconn`), keeps the rest in its queue
for at most a quarter of the budget, and answers the ones that waited longer itself, as gRPC
expects: HTTP 200 with `grpc-status: 8` (RESOURCE_EXHAUSTED) and a message, in one HEADERS
frame. In HTTP/2 mode it balances each call, not each connection, over the workers, so one
client connection's calls reach all of them.

`riskserve serve` with `RISKSERVE_FRONT=haproxy` (or `auto`, where HAProxy is installed) runs
it all (`serve_with_front`): `RISKSERVE_PROCESSES` workers, each on a Unix socket of its own in
a private folder, and HAProxy on `RISKSERVE_HOST:RISKSERVE_PORT` in front of them, started once
every worker listens. `riskserve front-config` writes the same configuration for workers run
some other way:

    riskserve front-config --out /etc/riskserve-front --workers 127.0.0.1:50052,127.0.0.1:50053
    haproxy -f /etc/riskserve-front/haproxy.cfg

Three backends share the workers. Scoring calls go to `calls`, the only one with the per-worker
limit and the queue. Streams go to `streams`: a stream holds its call for as long as it lives,
so under the limit a few would starve every unary caller; the worker bounds a stream's messages
itself. Health and readiness calls go to `control`, never queued behind scoring, so a probe
sees SERVING while the front sheds.

Where riskserve runs the workers, `calls` and `streams` reach each on its call lane, a second
Unix socket where the worker takes unary calls and bidirectional streams over HTTP/1.1
(`service.api.http1`): gRPC's Python transport costs a worker more CPU a call than the demo
model's run, the lane and HAProxy together a quarter of it. `control` reaches the worker's
gRPC socket (health's Watch streams from the server, which the lane does not take). A
configuration from `front-config`, for workers run some other way, sends every call to their
gRPC ports.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from service.config import Settings
from service.front_limits import WorkerLimits, queue_timeout_ms, worker_calls
from service.prctl import end_with_parent

__all__ = [
    "BUSY_MESSAGE",
    "busy_response",
    "find_haproxy",
    "front_tls",
    "haproxy_config",
    "queue_timeout_ms",
    "serve_with_front",
    "write",
]

log = logging.getLogger(__name__)

BUSY_MESSAGE = "riskserve front: no worker free within the queue time; retry later"
# Long-lived calls (streams) stay open: the front must not time them out.
_STREAM_TIMEOUT = "1h"
_STREAM_PATHS = (
    "/riskscoring.v1.RiskScoring/ScoreStream",
    "/inference.GRPCInferenceService/ModelStreamInfer",
)
_CONTROL_PATHS = (
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/inference.GRPCInferenceService/ModelReady",
)
_CONTROL_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Most client connections the front holds; each takes two descriptors (client, worker).
_MAX_CONNECTIONS = 4096
# Workers one HAProxy thread serves. A thread forwards a call for about 60 µs of CPU, and a
# Python worker answers at most about 1,500 calls a second, so one thread keeps up with ten of
# them; eight leave it room. More threads than needed cost more than they give: a call queued
# on one thread and dequeued by another (its worker's answer came in there) is handed between
# them, and with two threads and the queue in use the front took 120 to 225 µs a call instead
# of 60 (docs/benchmarks.md, "Overload").
WORKERS_PER_FRONT_THREAD = 8
# How often the supervising process looks at its workers and HAProxy, and sizes the workers'
# call limits from what each finished since: a worker full at two polls in a row is sized at
# the second (`service.front_limits`).
_POLL_S = 0.05


def busy_response(message: str = BUSY_MESSAGE) -> bytes:
    """The front's answer to a call it sheds: a trailers-only gRPC RESOURCE_EXHAUSTED."""
    return (
        "HTTP/1.1 200 OK\r\n"
        "content-type: application/grpc\r\n"
        "grpc-status: 8\r\n"
        f"grpc-message: {message}\r\n"
        "content-length: 0\r\n"
        "\r\n"
    ).encode()


def find_haproxy() -> str | None:
    """HAProxy's executable: on PATH, or where distributions install it (/usr/sbin)."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


def _max_connections() -> int:
    """Client connections the front may hold: at most 4,096, and within the descriptor limit
    HAProxy can raise itself to (it refuses to start with a maxconn beyond it)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        return _MAX_CONNECTIONS
    return max(64, min(_MAX_CONNECTIONS, (hard - 64) // 2))


def front_threads(workers: int) -> int:
    """HAProxy's threads before `workers` workers: one for each `WORKERS_PER_FRONT_THREAD`."""
    return max(1, math.ceil(workers / WORKERS_PER_FRONT_THREAD))


def _bracketed(host: str) -> str:
    """An address as HAProxy's `bind` takes it: an IPv6 one in brackets, given with or without."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class FrontTLS:
    """TLS the front terminates: one PEM with the certificate chain and key, and the CA that
    client certificates must chain to, where mutual TLS is required."""

    certificate_and_key: Path
    client_ca: Path | None = None

    def bind_options(self) -> str:
        options = f" ssl crt {self.certificate_and_key} alpn h2"
        if self.client_ca is not None:
            options += f" ca-file {self.client_ca} verify required"
        return options


def haproxy_config(
    settings: Settings,
    workers: Sequence[str],
    busy_file: Path,
    *,
    metrics_port: int | None = None,
    tls: FrontTLS | None = None,
    admin_socket: Path | None = None,
    call_lanes: Sequence[str] | None = None,
) -> str:
    """HAProxy's configuration for a front on the settings' address over `workers` (host:port,
    or a Unix socket's absolute path); `metrics_port`: HAProxy's Prometheus endpoint;
    `admin_socket`: its runtime API, through which each worker's limit is sized
    (`service.front_limits`); `call_lanes`: each worker's call lane (a Unix socket's path,
    `service.api.http1`), where unary calls and streams go over HTTP/1.1 instead of to
    `workers`."""
    if not workers:
        raise ValueError("the front needs at least one worker address")
    if call_lanes is not None and len(call_lanes) != len(workers):
        raise ValueError("the front needs one call lane a worker, or none")
    # Where riskserve sizes the limits, a worker starts at the most; a fixed config holds each
    # worker to the least, what suits a worker sharing its core (docs/reliability.md).
    sizing = worker_calls(settings)
    calls = sizing.most if admin_socket is not None else sizing.least
    addresses = [f"unix@{w}" if w.startswith("/") else w for w in workers]
    # Where calls and streams go: a call lane speaks HTTP/1.1 (HAProxy's default to a server),
    # a worker's gRPC port h2.
    scoring = (
        [(f"unix@{w}", "") for w in call_lanes]
        if call_lanes is not None
        else [(a, " proto h2") for a in addresses]
    )
    limited = "\n".join(
        f"    server worker{i} {address}{proto} maxconn {calls} check inter 1s id {i}"
        for i, (address, proto) in enumerate(scoring, 1)
    )
    tracking = "\n".join(
        f"    server worker{i} {address} proto h2 track calls/worker{i}"
        for i, address in enumerate(addresses, 1)
    )
    streaming = "\n".join(
        f"    server worker{i} {address}{proto} track calls/worker{i}"
        for i, (address, proto) in enumerate(scoring, 1)
    )
    bind = f"{_bracketed(settings.host)}:{settings.port}"
    bind_options = tls.bind_options() if tls is not None else " proto h2"
    metrics = ""
    if metrics_port:
        metrics = f"""
frontend metrics
    bind {_bracketed(settings.metrics_host)}:{metrics_port}
    no log
    http-request use-service prometheus-exporter if {{ path /metrics }}
"""
    runtime_api = refusals = ""
    held = f"at most {calls} a worker"
    if admin_socket is not None:
        held = f"{calls} a worker at first, then what each finishes in time (riskserve sets it)"
        runtime_api = f"\n    stats socket {admin_socket} mode 600 level admin"
        # A worker's refusals (an error status with no message: gRPC's trailers-only answer,
        # its status among the headers) counted by server id: they are not calls it finished.
        refused = "{ res.hdr(grpc-status) -m found } !{ res.hdr(grpc-status) -m str 0 }"
        refusals = f"""
    stick-table type integer size {len(workers)} store gpc0
    http-response track-sc0 srv_id if {refused}
    http-response sc-inc-gpc0(0) if {refused}"""
    return f"""# Written by riskserve from the RISKSERVE_* settings; do not edit.
global
    nbthread {front_threads(len(workers))}{runtime_api}
    maxconn {_max_connections()}
    hard-stop-after {math.ceil(settings.shutdown_grace_s + _queue_drain_s(settings)) + 2}s
    noreuseport
    log stderr format raw local0 err

defaults
    mode http
    log global
    option abortonclose
    http-reuse always
    timeout connect 1s
    timeout client {_STREAM_TIMEOUT}
    timeout server {_STREAM_TIMEOUT}
    timeout queue {queue_timeout_ms(settings)}ms
    errorfile 503 {busy_file}

frontend grpc
    bind {bind}{bind_options}
    use_backend streams if {{ path {" ".join(_STREAM_PATHS)} }}
    use_backend control if {{ path_beg {" ".join(_CONTROL_PREFIXES)} }}
    use_backend control if {{ path {" ".join(_CONTROL_PATHS)} }}
    default_backend calls

# Scoring calls: {held}, the rest queued for {queue_timeout_ms(settings)} ms.
backend calls
    balance leastconn{refusals}
{limited}

backend streams
    balance leastconn
{streaming}

backend control
    balance roundrobin
{tracking}
{metrics}"""


def write(
    directory: Path,
    settings: Settings,
    workers: Sequence[str],
    *,
    metrics_port: int | None = None,
    tls: FrontTLS | None = None,
    admin_socket: Path | None = None,
    call_lanes: Sequence[str] | None = None,
) -> Path:
    """Write haproxy.cfg and the answer to a shed call into `directory`; the config's path."""
    directory.mkdir(parents=True, exist_ok=True)
    busy = directory / "busy.http"
    busy.write_bytes(busy_response())
    config = directory / "haproxy.cfg"
    config.write_text(
        haproxy_config(
            settings,
            workers,
            busy.resolve(),
            metrics_port=metrics_port,
            tls=tls,
            admin_socket=admin_socket,
            call_lanes=call_lanes,
        )
    )
    return config


def front_tls(settings: Settings, directory: Path) -> FrontTLS | None:
    """The settings' certificate and key as the one PEM HAProxy reads, private to the user."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    pem = directory / "front.pem"
    descriptor = os.open(pem, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        chain = settings.tls_cert_file.read_bytes()
        out.write(chain if chain.endswith(b"\n") else chain + b"\n")
        out.write(settings.tls_key_file.read_bytes())
    return FrontTLS(pem, settings.tls_client_ca_file)


def _run_worker(settings: Settings, address: str, calls_path: str) -> None:
    import asyncio

    from service.server import serve

    # Forked, a worker holds the front's signal handlers until `serve` sets its own, after
    # loading its models: until then a stop ends it, and a reload or a log roll waits.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # The front decides when workers stop: a Ctrl-C in a terminal reaches it alone.
    os.setpgid(0, 0)
    end_with_parent()
    asyncio.run(serve(settings, address=address, calls_path=calls_path))


def _accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _queue_drain_s(settings: Settings) -> float:
    """How long a stop lets the front's queue empty before the workers drain: twice the time
    a call may wait in it."""
    return 2 * queue_timeout_ms(settings) / 1e3


def _check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on, as a lone server does, before the workers
    load: HAProxy would fail to bind it (it binds without SO_REUSEPORT here), while the port,
    answering, looked open to the start."""
    address = host.strip("[]")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as HAProxy binds
        try:
            probe.bind((address, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise OSError(
                errno.EADDRINUSE,
                f"cannot listen on {_bracketed(host)}:{port}: the port is in use; choose "
                "another port (RISKSERVE_PORT or --port)",
            ) from None


def _port_open(host: str, port: int) -> bool:
    reach = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    try:
        with socket.create_connection((reach.strip("[]"), port), timeout=1):
            return True
    except OSError:
        return False


class _Front:
    """The workers and HAProxy of one `riskserve serve`, started and stopped in order."""

    def __init__(self, settings: Settings, haproxy: str) -> None:
        self.settings = settings
        self.haproxy = haproxy
        self.directory = Path(tempfile.mkdtemp(prefix="riskserve-front-"))
        self.sockets = [self.directory / f"worker{i}.sock" for i in range(settings.processes)]
        self.lanes = [self.directory / f"worker{i}.calls.sock" for i in range(settings.processes)]
        self.workers: list[multiprocessing.process.BaseProcess] = []
        self.proxy: subprocess.Popen[bytes] | None = None
        self.stopping = threading.Event()
        self.limits = WorkerLimits.for_settings(settings, self.directory / "haproxy.sock")

    def start_workers(self) -> None:
        context = multiprocessing.get_context("fork")  # before any gRPC state exists here
        for index, (path, lane) in enumerate(zip(self.sockets, self.lanes, strict=True)):
            metrics_port = self.settings.metrics_port
            if metrics_port:
                metrics_port += index
            worker_settings = self.settings.model_copy(update={"metrics_port": metrics_port})
            worker = context.Process(
                target=_run_worker,
                args=(worker_settings, f"unix:{path}", str(lane)),
                name=f"riskserve-{index}",
            )
            worker.start()
            self.workers.append(worker)

    def wait_for_workers(self) -> bool:
        """Until every worker accepts calls; False when one ended first, or on a signal."""
        waiting = [*self.sockets, *self.lanes]
        while waiting:
            if self.stopping.is_set() or self.ended_worker() is not None:
                return False
            waiting = [path for path in waiting if not _accepts(path)]
            if waiting:
                time.sleep(0.05)
        return True

    def start_proxy(self) -> bool:
        """HAProxy on the service's port; False when it exits before the port opens."""
        settings = self.settings
        config = write(
            self.directory,
            settings,
            [str(path) for path in self.sockets],
            metrics_port=settings.front_metrics_port_resolved,
            tls=front_tls(settings, self.directory),
            admin_socket=self.limits.socket_path if self.limits is not None else None,
            call_lanes=[str(path) for path in self.lanes],
        )
        self.proxy = subprocess.Popen(
            [self.haproxy, "-db", "-f", str(config)],
            process_group=0,
            preexec_fn=end_with_parent,
        )
        while not _port_open(settings.host, settings.port):
            if self.proxy.poll() is not None:
                return False
            time.sleep(0.02)
        return True

    def ended_worker(self) -> multiprocessing.process.BaseProcess | None:
        return next((w for w in self.workers if not w.is_alive()), None)

    def forward(self, signum: int) -> None:
        for worker in self.workers:
            if worker.pid is not None and worker.is_alive():
                os.kill(worker.pid, signum)

    def stop(self) -> None:
        """Stop taking calls, let the queued and the running ones finish, then end.

        HAProxy's soft stop (SIGUSR1) closes the port and tells HTTP/2 clients to go (GOAWAY)
        while the calls it holds go on; once its queue has had time to empty, the workers
        drain as a lone server does (NOT_SERVING, no new calls, in-flight calls answered
        within the grace, streams ended).
        """
        grace_s = self.settings.shutdown_grace_s
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.send_signal(signal.SIGUSR1)
            # Time for its queue to empty; a HAProxy that holds no call ends at once.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proxy.wait(_queue_drain_s(self.settings))
        self.forward(signal.SIGTERM)
        for worker in self.workers:
            worker.join(grace_s + 5)
            if worker.is_alive():
                worker.kill()
                worker.join()
        if self.proxy is not None:
            try:
                self.proxy.wait(grace_s + 5)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    def supervise(self) -> int:
        """Until a signal asks to stop (0) or a worker or HAProxy ends by itself (1); in the
        meantime each worker's call limit follows what it finishes (`WorkerLimits`)."""
        assert self.proxy is not None
        while not self.stopping.wait(_POLL_S):
            if self.limits is not None:
                self.limits.poll()
            ended = self.ended_worker()
            if ended is not None:
                log.error("%s ended (exit status %s): stopping", ended.name, ended.exitcode)
                return 1
            if self.proxy.poll() is not None:
                log.error("haproxy ended (exit status %s): stopping", self.proxy.returncode)
                return 1
        return 0


def serve_with_front(settings: Settings, haproxy: str) -> int:
    """Serve `settings.processes` workers behind HAProxy until SIGTERM or SIGINT, then drain;
    SIGHUP (reload models) and SIGUSR1 (roll experiment logs) go on to every worker."""
    _check_port_free(settings.host, settings.port)
    front = _Front(settings, haproxy)
    signal.signal(signal.SIGTERM, lambda *_: front.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: front.stopping.set())
    signal.signal(signal.SIGHUP, lambda signum, _: front.forward(signum))
    signal.signal(signal.SIGUSR1, lambda signum, _: front.forward(signum))
    status = 1
    try:
        front.start_workers()
        if not front.wait_for_workers():
            ended = front.ended_worker()
            if ended is None:
                return 0  # asked to stop while the models loaded
            log.error("%s ended while loading (exit status %s)", ended.name, ended.exitcode)
            return 1
        if not front.start_proxy():
            log.error("haproxy did not start (its message is above)")
            return 1
        log.info("front: haproxy before %d worker process(es)", len(front.workers))
        print(f"riskserve listening on {settings.host}:{settings.port}", flush=True)
        status = front.supervise()
        return status
    finally:
        front.stop()
