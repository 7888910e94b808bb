"""A benchmark sent SIGTERM still stops the servers it started (they run in their own sessions)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench.servers import free_port

REPO = Path(__file__).resolve().parents[2]

# A benchmark in miniature: one do-nothing gRPC server, held open until the process is killed.
SCRIPT = """
import sys, time
from bench.rpc_floor import echo_spec
from bench.servers import ServerProcess
with ServerProcess(echo_spec(int(sys.argv[1])), __import__("pathlib").Path(sys.argv[2])) as s:
    print(s.pid, flush=True)
    time.sleep(120)
"""


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_sigterm_to_the_benchmark_stops_its_server(tmp_path: Path):
    with subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(free_port()), str(tmp_path / "echo.log")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    ) as bench:
        _stop_with_sigterm(bench)


def _stop_with_sigterm(bench: subprocess.Popen[str]) -> None:
    try:
        assert bench.stdout is not None
        line = bench.stdout.readline()  # once the server answers
        assert line.strip().isdigit(), f"the benchmark did not start its server: {line!r}"
        server = psutil.Process(int(line))
        assert server.is_running() and os.getpgid(server.pid) != os.getpgid(bench.pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while not _gone(server):
            assert time.monotonic() < deadline, "the server outlived its benchmark"
            time.sleep(0.05)
    finally:
        if bench.poll() is None:
            bench.kill()
