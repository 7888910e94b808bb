"""A real riskserve on a loopback port, run on its own event loop thread for sync tests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.config import Settings
from service.front import find_haproxy
from service.models.loader import EngineFactory
from service.server import RiskServer, build_server

REPO = Path(__file__).resolve().parents[2]

# HAProxy, for the tests of the front; they are skipped, saying why, where it is missing.
HAPROXY = find_haproxy()
needs_haproxy = pytest.mark.skipif(
    HAPROXY is None,
    reason="no haproxy here: `make test` installs Debian's haproxy where apt-get runs as root",
)


def socket_folder(output: list[str]) -> Path:
    """The private folder of the front's sockets, from the log of `riskserve serve`."""
    line = next(line for line in output if " on unix:" in line)
    return Path(line.split(" on unix:")[1].strip()).parent


class LiveServer:
    def __init__(
        self,
        engine_factory: EngineFactory | None = None,
        calls_path: Path | None = None,
        **settings: Any,
    ) -> None:
        self._engine_factory = engine_factory
        self._calls_path = calls_path  # a call lane's socket (service.api.http1)
        settings.setdefault("port", 0)
        settings.setdefault("metrics_port", None)
        settings.setdefault("trace_file", None)
        settings.setdefault("warmup_iterations", 1)
        self.settings = Settings(**settings)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.server: RiskServer | None = None

    def __enter__(self) -> LiveServer:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            build_server(
                self.settings,
                self._engine_factory,
                calls_path=None if self._calls_path is None else str(self._calls_path),
            ),
            self._loop,
        )
        self.server = future.result(timeout=120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, coro: Any, timeout_s: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout_s)

    def stop(self) -> None:
        if self.server is not None:
            self.call(self.server.stop())
            self.server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)


@contextmanager
def server_process(
    models_dir: Path,
    argv: tuple[str, ...] = ("-m", "service", "serve"),
    output: list[str] | None = None,
    **env: str,
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`riskserve serve` (or Python with `argv`) in a child process; yields it and its target
    once it listens. `output`, where given, receives the process's log lines as they come."""
    environ = {
        **os.environ,
        "RISKSERVE_MODELS_DIR": str(models_dir),
        "RISKSERVE_PORT": "0",
        "RISKSERVE_METRICS_PORT": "none",
        "RISKSERVE_TRACE_FILE": "none",
        "RISKSERVE_WARMUP_ITERATIONS": "1",
        **env,
    }
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    target = None
    started = time.monotonic()
    assert proc.stdout is not None
    lines = []
    while time.monotonic() - started < 120:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("riskserve listening on "):
            target = line.split()[-1]
            break
    if target is None:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
        raise RuntimeError("server did not start:\n" + "".join(lines))
    if output is not None:
        output.extend(lines)

    def drain_output() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if output is not None:
                output.append(line)

    drain = threading.Thread(target=drain_output, daemon=True)
    drain.start()
    try:
        yield proc, target
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        drain.join(timeout=10)
        proc.stdout.close()


def experiment_server(
    models: Path, config: Path, logs: Path, default_model: str, **settings: Any
) -> LiveServer:
    """A live server running the experiments of `config`, its records soon in Parquet files."""
    return LiveServer(
        models_dir=models,
        experiments_file=config,
        shadow_log_prefix=str(logs),
        shadow_flush_interval_s=0.1,
        shadow_max_file_age_s=0.2,  # records reach Parquet files soon after they are served
        default_model=default_model,
        budget_ms=5000,
        onnx_variants=False,
        tensorrt=False,
        **settings,
    )


async def riskscoring_server(servicer: pb_grpc.RiskScoringServicer) -> tuple[grpc.aio.Server, str]:
    """`servicer` alone on a grpc.aio server on a loopback port, started (a stand-in server
    that answers as a test needs, where riskserve would answer right); it and its target."""
    server = grpc.aio.server()
    pb_grpc.add_RiskScoringServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
