"""A server's CPU, as the benchmarks count it, is that of the processes answering calls: a
shadow worker it starts (in a session of its own, as the runner spawns it) is counted apart."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
from waiting import wait_until

from bench.servers import SHADOW_WORKER, ServerProcess, ServerSpec

# A server that idles after spawning, as service/shadow/runner.py does, a worker that burns CPU
# and names itself a shadow worker on its command line.
_SERVER = textwrap.dedent(f"""
    import os, sys, time
    burn = "while True: pass"
    worker = [sys.executable, "-c", burn, "-m", {SHADOW_WORKER!r}]
    os.posix_spawn(sys.executable, worker, os.environ, setsid=True)
    time.sleep(120)
""")


def _worker_cpu_s(server: psutil.Process) -> float:
    return sum(
        sum(p.cpu_times()[:2])
        for p in server.children(recursive=True)
        if SHADOW_WORKER in p.cmdline()
    )


def test_a_shadow_worker_is_not_counted_in_the_servers_cpu(tmp_path: Path):
    spec = ServerSpec("stand-in", (sys.executable, "-c", _SERVER), 0, "none")
    server = ServerProcess(spec, tmp_path / "server.log")
    # Started by hand: the stand-in answers no readiness call, which start() waits for.
    server._process = subprocess.Popen(spec.argv, start_new_session=True)
    root = psutil.Process(server.pid)
    try:
        wait_until(lambda: _worker_cpu_s(root) > 1.0, 60)
        assert server.cpu_seconds() < 0.5  # the idle server alone
    finally:
        for process in root.children(recursive=True):
            process.kill()
        server._process.kill()
        server._process.wait()
