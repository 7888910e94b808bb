"""A start that fails part-way (here: its port taken, after the models loaded) stops what it had
set going, so a process that goes on (a test, a program embedding the server) keeps no engine,
loader, trace-export or metrics thread, and no port, of a server that never served."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest
from modelkit import write_sequence_model

from service.config import Settings
from service.server import build_server


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_start_whose_port_is_taken_leaves_no_thread_or_port_behind(tmp_path: Path):
    write_sequence_model(tmp_path / "models")
    metrics_port = _free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = Settings(
            models_dir=tmp_path / "models",
            port=taken.getsockname()[1],
            metrics_port=metrics_port,
            trace_file=tmp_path / "traces.jsonl",
            warmup_iterations=1,
        )
        before = {thread.ident for thread in threading.enumerate()}
        with pytest.raises(RuntimeError, match="Failed to bind"):
            asyncio.run(build_server(settings))
    left = [
        t.name
        for t in threading.enumerate()
        # gRPC's own poller, started with its first server, lives as long as the process.
        if t.ident not in before and t.is_alive() and "_poll_wrapper" not in t.name
    ]
    assert left == []
    with socket.socket() as again:  # the metrics port it had opened is closed
        again.bind(("127.0.0.1", metrics_port))
