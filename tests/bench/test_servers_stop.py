"""A benchmark sent SIGTERM still stops the servers it started (they run in their own sessions)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from waiting import wait_until

from bench.servers import _exit_on_sigterm, _raise_exit, free_port

REPO = Path(__file__).resolve().parents[2]

# Each benchmark in miniature starts with SIGTERM at its default, as from a shell: a test runner
# may itself ignore SIGTERM, and a child inherits that (an ignored SIGTERM is left alone, see the
# last test). It waits in short sleeps, as a benchmark's loop does: Python runs a handler between
# bytecodes, so a signal that lands just before one long sleep begins would wait that sleep out.
PRELUDE = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, signal.SIG_DFL)
from bench.servers import ServerProcess, ServerSpec
"""

# One do-nothing gRPC server, held open until the process is killed.
SERVING = (
    PRELUDE
    + """
from bench.rpc_floor import echo_spec
with ServerProcess(echo_spec(int(sys.argv[1])), Path(sys.argv[2])) as s:
    print(s.pid, flush=True)
    for _ in range(1200):
        time.sleep(0.1)
"""
)

# A server that never answers, so the benchmark is still waiting for it when the signal comes;
# the server writes its process id to its log.
STARTING = (
    PRELUDE
    + """
server = (sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)")
with ServerProcess(ServerSpec("never ready", server, int(sys.argv[1]), "m"), Path(sys.argv[2])):
    pass
"""
)


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_sigterm_to_the_benchmark_stops_its_server(tmp_path: Path):
    with _benchmark(SERVING, tmp_path / "echo.log") as bench:
        assert bench.stdout is not None
        line = bench.stdout.readline()  # once the server answers
        assert line.strip().isdigit(), f"the benchmark did not start its server: {line!r}"
        _stop_with_sigterm(bench, psutil.Process(int(line)))


def test_sigterm_while_the_benchmark_waits_for_its_server_stops_that_server(tmp_path: Path):
    log = tmp_path / "never-ready.log"
    with _benchmark(STARTING, log) as bench:
        # Until the server has written its process id, or the benchmark has ended early.
        wait_until(lambda: bench.poll() is not None or _pid_written(log))
        assert bench.poll() is None, "the benchmark ended before it was sent SIGTERM"
        _stop_with_sigterm(bench, psutil.Process(int(log.read_text())))


def _pid_written(log: Path) -> bool:
    return log.exists() and log.read_text().strip().isdigit()


def _benchmark(script: str, log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, str(free_port()), str(log)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )


def _stop_with_sigterm(bench: subprocess.Popen[str], server: psutil.Process) -> None:
    try:
        assert server.is_running() and os.getpgid(server.pid) != os.getpgid(bench.pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        wait_until(lambda: _gone(server), timeout_s=10)  # else: the server outlived it
    finally:
        if bench.poll() is None:
            bench.kill()
        if not _gone(server):
            server.kill()


def test_an_ignored_sigterm_stays_ignored_and_a_default_one_becomes_an_exit():
    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as under `nohup`-like runners
        _exit_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _exit_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is _raise_exit
    finally:
        signal.signal(signal.SIGTERM, before)
