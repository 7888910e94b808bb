"""The front: an HAProxy configuration, from the settings, that sheds calls before Python.

A gRPC server in Python pays for a call it refuses about what it pays for one it answers, and
calls beyond what it can finish wait in gRPC's core, unseen, until their callers give up. A
front in C holds each worker to a few calls at a time (`maxconn`), keeps the rest in its queue
for at most a third of the budget, and answers the ones that waited longer itself, as gRPC
expects: HTTP 200 with `grpc-status: 8` (RESOURCE_EXHAUSTED) and a message, in one HEADERS
frame. In HTTP/2 mode it balances each call, not each connection, over the workers, so one
client connection's calls reach all of them.

    riskserve front-config --out /etc/riskserve-front --workers 127.0.0.1:50052,127.0.0.1:50053
    haproxy -f /etc/riskserve-front/haproxy.cfg

The front binds `RISKSERVE_HOST:RISKSERVE_PORT`; the workers serve on ports of their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from service.config import Settings

__all__ = ["BUSY_MESSAGE", "DEFAULT_WORKER_CALLS", "busy_response", "haproxy_config", "write"]

# Calls one worker takes at a time when max_requests_in_progress leaves it to the server.
DEFAULT_WORKER_CALLS = 8
BUSY_MESSAGE = "riskserve front: no worker free within the queue time; retry later"
# Long-lived calls (streams) stay open: the front must not time them out.
_STREAM_TIMEOUT = "1h"


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


def queue_timeout_ms(settings: Settings) -> int:
    """How long a call may wait in the front for a free worker: a third of the budget."""
    return max(1, math.floor(settings.budget_ms / 3))


def haproxy_config(settings: Settings, workers: Sequence[str], busy_file: Path) -> str:
    """HAProxy's configuration for a front on the settings' address over `workers`."""
    if not workers:
        raise ValueError("the front needs at least one worker address")
    calls = settings.max_requests_in_progress or DEFAULT_WORKER_CALLS
    servers = "\n".join(
        f"    server worker{i} {address} proto h2 maxconn {calls} check inter 1s"
        for i, address in enumerate(workers, 1)
    )
    host = settings.host if ":" not in settings.host else f"[{settings.host}]"
    return f"""# Written by `riskserve front-config` from the RISKSERVE_* settings; do not edit.
global
    maxconn 4096
    log stderr format raw local0 err

defaults
    mode http
    log global
    timeout connect 1s
    timeout client {_STREAM_TIMEOUT}
    timeout server {_STREAM_TIMEOUT}
    timeout queue {queue_timeout_ms(settings)}ms
    errorfile 503 {busy_file}

frontend grpc
    bind {host}:{settings.port} proto h2
    default_backend workers

backend workers
    balance leastconn
{servers}
"""


def write(directory: Path, settings: Settings, workers: Sequence[str]) -> Path:
    """Write haproxy.cfg and the answer to a shed call into `directory`; the config's path."""
    directory.mkdir(parents=True, exist_ok=True)
    busy = directory / "busy.http"
    busy.write_bytes(busy_response())
    config = directory / "haproxy.cfg"
    config.write_text(haproxy_config(settings, workers, busy.resolve()))
    return config
