"""Servers under test as child processes: start, wait until the model is ready, stop.

Each kind (riskserve, Triton, MLServer) supplies its command line and environment; this module
owns the process lifetime. A server's output goes to a log file next to the results, so a
failure to start can be read afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.oip import wait_model_ready
from service.telemetry.stats import scrape

__all__ = [
    "ServerProcess",
    "ServerSpec",
    "add_standalone_arguments",
    "free_port",
    "metric_sum",
    "scrape_metrics",
    "serve_alone",
]

# The module a shadow worker runs (`python -m service.shadow.worker`), as its command line shows.
SHADOW_WORKER = "service.shadow.worker"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape_metrics(port: int, timeout_s: float = 5.0) -> str:
    """A riskserve server's Prometheus text from 127.0.0.1:`port`."""
    return scrape(f"http://127.0.0.1:{port}/metrics", timeout_s)


def metric_sum(metrics_text: str, sample: str) -> float:
    """A sample's values (e.g. `riskserve_requests_total`) summed over all its label sets."""
    return sum(
        s.value
        for family in text_string_to_metric_families(metrics_text)
        for s in family.samples
        if s.name == sample
    )


@dataclass(frozen=True)
class ServerSpec:
    """How to launch one server: its command, environment additions and gRPC port."""

    name: str
    argv: tuple[str, ...]
    grpc_port: int
    model_name: str
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    startup_timeout_s: float = 120.0
    supports_model_config: bool = True


def _exit_on_sigterm() -> None:
    """Make a SIGTERM to this process a SystemExit, so context managers stop its servers.

    Each server runs in a session of its own (so that stop() reaches its workers), which a
    signal to the benchmark does not reach: without this, `kill` or `timeout` would leave them
    running. Only from the main thread, and only where nobody set a handler of their own.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class ServerProcess:
    """A running server; use as a context manager so it is always stopped, even when the
    benchmark is sent SIGTERM."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.spec.grpc_port}"

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        env = {**os.environ, **self.spec.env}
        _exit_on_sigterm()
        started = time.monotonic()
        # A new session, so stop() can signal the server and any workers it forks.
        self._process = subprocess.Popen(
            self.spec.argv,
            env=env,
            cwd=self.spec.cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_model_ready(
                self.target,
                self.spec.model_name,
                self.spec.startup_timeout_s,
                is_alive=lambda: self._process is not None and self._process.poll() is None,
            )
        except (KeyboardInterrupt, SystemExit):  # stopped while waiting: the server goes too
            self.stop()
            raise
        except Exception:
            self.stop()
            raise RuntimeError(
                f"{self.spec.name} did not become ready; its log is {self.log_path}"
            ) from None
        self.startup_s = time.monotonic() - started
        return self

    @property
    def pid(self) -> int:
        """The server's process id (also its process group's)."""
        if self._process is None:
            raise RuntimeError(f"{self.spec.name} is not running")
        return self._process.pid

    def cpu_seconds(self) -> float:
        """User plus system CPU time of every live process the server started to answer calls:
        its process group, and its descendants in groups of their own (the front's workers and
        HAProxy). A shadow worker is left out: it scores challengers off the hot path, and the
        benchmarks that run one count it apart (`bench.shadow_overhead`)."""
        if self._process is None:
            return math.nan
        group, total = self._process.pid, 0.0
        try:
            tree = {p.pid for p in psutil.Process(group).children(recursive=True)} | {group}
        except psutil.Error:
            tree = set()
        for process in psutil.process_iter(["cmdline"]):
            try:
                if SHADOW_WORKER in (process.info["cmdline"] or ()):
                    continue
                if process.pid in tree or os.getpgid(process.pid) == group:
                    times = process.cpu_times()
                    total += times.user + times.system
            except (ProcessLookupError, psutil.Error):
                continue  # exited while we looked
        return total

    def stop(self, grace_s: float = 15.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def add_standalone_arguments(
    parser: argparse.ArgumentParser, grpc_port: int, http_port: int, metrics_port: int
) -> None:
    """The options every peer server started alone takes: model, ports, batch size, time."""
    parser.add_argument("--model", type=Path, default=None, help="ONNX file (default: demo model)")
    parser.add_argument("--grpc-port", type=int, default=grpc_port)
    parser.add_argument("--http-port", type=int, default=http_port)
    parser.add_argument("--metrics-port", type=int, default=metrics_port)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--intra-op-threads", type=int, default=1)
    parser.add_argument("--serve-s", type=float, default=600.0, help="stop after this long")


def serve_alone(spec: ServerSpec, log_path: Path, serve_s: float) -> int:
    """Runs one server until Ctrl-C or `serve_s` seconds, for loading it by hand."""
    with ServerProcess(spec, log_path) as server:
        print(f"{spec.name} ready on {server.target} in {server.startup_s:.1f} s; Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(serve_s)
    print(f"{spec.name} stopped")
    return 0
