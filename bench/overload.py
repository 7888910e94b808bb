"""64 callers in a tight loop, with and without a 10 ms deadline: goodput, the caller's p99, health.

A riskserve server (defaults: tracing and metrics on) is started on 127.0.0.1; client processes
run `--callers` OIP ModelInfer callers between them, each sending its next request as soon as the
last one is answered, whatever the answer, for `--duration-s`; one more caller asks the standard
health service every 50 ms. Each mode (a gRPC deadline of `--deadline-ms` on every call, then
none) prints the OK answers a second, the status counts, the client-side p50 and p99 of the OK
answers, and whether health said SERVING every time it was asked. The issue's bar: OK answers at
least 80 % of the best rate within the budget, their p99 within the budget, SERVING throughout.

    .venv/bin/python -m bench.overload --callers 64 --duration-s 10

The callers are Python on the same cores as the server, as a decision system's clients would not
be; what they take from the server shows as a lower rate. `--max-concurrent-streams N` serves
with at most N calls open on each client connection (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS):
a client holds its calls beyond that itself, where their deadlines still run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.model_io import make_request_arrays, read_model_io, resolve_model_path
from bench.oip import MODEL_INFER_METHOD, build_infer_request
from bench.servers import ServerProcess, ServerSpec, free_port
from inference import grpc_service_pb2 as oip

REPO = Path(__file__).resolve().parents[1]
RISKSERVE = REPO / ".venv" / "bin" / "riskserve"


def _callers(target: str, callers: int, duration_s: float, deadline_s: float | None) -> tuple:
    """One client process: `callers` tight loops; (OK latencies in s, status counts)."""
    io = read_model_io(resolve_model_path(None))
    request = build_infer_request("fraud-demo", make_request_arrays(io, 32, seed=1), io.output)

    async def run() -> tuple[list[float], Counter[str]]:
        ok: list[float] = []
        statuses: Counter[str] = Counter()
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.unary_unary(
                MODEL_INFER_METHOD,
                request_serializer=oip.ModelInferRequest.SerializeToString,
                response_deserializer=oip.ModelInferResponse.FromString,
            )
            await call(request, timeout=5)
            end = time.perf_counter() + duration_s

            async def loop() -> None:
                while time.perf_counter() < end:
                    started = time.perf_counter()
                    try:
                        await call(request, timeout=deadline_s)
                    except grpc.aio.AioRpcError as exc:
                        statuses[exc.code().name] += 1
                    else:
                        ok.append(time.perf_counter() - started)
                        statuses["OK"] += 1

            await asyncio.gather(*(loop() for _ in range(callers)))
        return ok, statuses

    return asyncio.run(run())


async def _watch_health(target: str, duration_s: float) -> Counter[str]:
    seen: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        end = time.perf_counter() + duration_s
        while time.perf_counter() < end:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                seen[health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)] += 1
            except grpc.aio.AioRpcError as exc:
                seen[exc.code().name] += 1
            await asyncio.sleep(0.05)
    return seen


def _mode(target: str, args: argparse.Namespace, deadline_s: float | None) -> str:
    procs = max(1, args.client_procs)
    shares = [args.callers // procs + (i < args.callers % procs) for i in range(procs)]
    with ProcessPoolExecutor(procs, mp_context=get_context("spawn")) as pool:
        futures = [
            pool.submit(_callers, target, n, args.duration_s, deadline_s) for n in shares if n
        ]
        health = asyncio.run(_watch_health(target, args.duration_s + 1.0))
        results = [f.result() for f in futures]
    latencies = np.array([s for ok, _ in results for s in ok]) * 1e3
    statuses: Counter[str] = sum((c for _, c in results), Counter())
    p50, p99 = np.percentile(latencies, [50, 99]) if latencies.size else (np.nan, np.nan)
    serving = set(health) == {"SERVING"}
    label = f"{deadline_s * 1e3:g} ms deadline" if deadline_s else "no deadline"
    shown = ", ".join(f"{k} {v}" for k, v in statuses.most_common())
    return (
        f"| {label} | {statuses['OK'] / args.duration_s:,.0f} | {p50:.2f} | {p99:.2f} | "
        f"{shown} | {'yes' if serving else dict(health)} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--deadline-ms", type=float, default=10.0)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--processes", default="1", help="RISKSERVE_PROCESSES for the server")
    parser.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=None,
        help="RISKSERVE_MAX_CONCURRENT_STREAMS for the server (default: the server's own)",
    )
    args = parser.parse_args(argv)
    port = free_port()
    env = {
        "RISKSERVE_PORT": str(port),
        "RISKSERVE_METRICS_PORT": str(free_port()),
        "RISKSERVE_TRACE_FILE": "none",
        "RISKSERVE_PROCESSES": args.processes,
    }
    if args.max_concurrent_streams is not None:
        env["RISKSERVE_MAX_CONCURRENT_STREAMS"] = str(args.max_concurrent_streams)
    spec = ServerSpec(
        "riskserve",
        (str(RISKSERVE), "serve", "--port", str(port)),
        port,
        "fraud-demo",
        env=env,
        cwd=REPO,
    )
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"{args.callers} callers in a tight loop, {args.client_procs} client processes, "
        f"{args.duration_s:g} s a mode; server processes {args.processes}; "
        f"streams a connection {args.max_concurrent_streams or 'default'}; load average {load}"
    )
    rows = []
    with ServerProcess(spec, REPO / "bench" / "results" / "overload-server.log") as server:
        for deadline_s in (args.deadline_ms / 1e3, None):
            rows.append(_mode(server.target, args, deadline_s))
    print("| mode | OK answers/s | OK p50 ms | OK p99 ms | statuses | health SERVING throughout |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
