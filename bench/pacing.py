"""One caller at a time, with a pause between calls: what an idle machine adds to a round trip.

A light load reaches a server whose threads have gone idle between requests, and each hop of
the round trip (client, gRPC's core threads, the event loop) may then have to be woken. This
benchmark measures what that adds: one synchronous caller sends OIP ModelInfer requests (batch
1, history 32) one after another, pausing `--gaps-ms` between calls (0: back to back), to
riskserve and to the do-nothing grpc.aio server (`grpc-floor`, bench/rpc_floor.py) in turn,
each started as `bench.compare` starts it. Per server and gap it prints the client's p50 / p90 /
p99 and, for riskserve, its own mean request time over the same calls, from its metrics. A cost
both servers pay as the gap grows belongs to the machine and the transport, not to riskserve.

    .venv/bin/python -m bench.pacing --gaps-ms 0,1,10 --calls 1500
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc
import numpy as np

from bench.compare import FLOOR, RESULTS_DIR, riskserve_knobs, server_spec
from bench.model_io import make_request_arrays, read_model_io, resolve_model_path
from bench.oip import MODEL_INFER_METHOD, build_infer_request
from bench.servers import ServerProcess, metric_sum, scrape_metrics
from inference import grpc_service_pb2 as oip


def _server_seconds(metrics_port: int) -> tuple[float, float]:
    """riskserve's summed request time and request count, from its request-duration histogram."""
    text = scrape_metrics(metrics_port)
    return (
        metric_sum(text, "riskserve_request_duration_seconds_sum"),
        metric_sum(text, "riskserve_request_duration_seconds_count"),
    )


def _paced(
    target: str,
    request: oip.ModelInferRequest,
    calls: int,
    gap_s: float,
    metrics_port: int | None,
) -> tuple[np.ndarray, float | None]:
    """Client-side latencies in ms of `calls` sequential calls, `gap_s` apart, and where the
    server has metrics on `metrics_port`, its own mean request time in ms over those calls."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            MODEL_INFER_METHOD,
            request_serializer=oip.ModelInferRequest.SerializeToString,
            response_deserializer=oip.ModelInferResponse.FromString,
        )
        for _ in range(50):  # warm the connection and the server
            call(request, timeout=5)
        before = _server_seconds(metrics_port) if metrics_port is not None else None
        latencies = np.empty(calls)
        for i in range(calls):
            started = time.perf_counter()
            call(request, timeout=5)
            latencies[i] = time.perf_counter() - started
            if gap_s:
                time.sleep(gap_s)
    server_mean_ms = None
    if before is not None and metrics_port is not None:
        after = _server_seconds(metrics_port)
        seconds, count = after[0] - before[0], after[1] - before[1]
        server_mean_ms = seconds / count * 1e3 if count else None
    return latencies * 1e3, server_mean_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gaps-ms", default="0,1,10", help="pauses between calls, comma-separated")
    parser.add_argument("--calls", type=int, default=1500, help="calls per server and gap")
    args = parser.parse_args(argv)
    gaps_s = [float(g) / 1e3 for g in args.gaps_ms.split(",") if g.strip()]
    onnx_path = resolve_model_path(None)
    io = read_model_io(onnx_path)
    request = build_infer_request("fraud-demo", make_request_arrays(io, 32, seed=1), io.output)
    riskserve = server_spec("riskserve", onnx_path, riskserve_knobs(None))
    floor = server_spec(FLOOR, onnx_path, riskserve_knobs(None))
    metrics_port = int(riskserve.env["RISKSERVE_METRICS_PORT"])
    print(f"one caller, {args.calls} calls per point, ModelInfer batch 1, history 32")
    print("| server | pause between calls | client p50 ms | p90 ms | p99 ms | server mean ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for spec, metrics in ((riskserve, metrics_port), (floor, None)):
        with ServerProcess(spec, RESULTS_DIR / f"pacing-{spec.name}.log") as server:
            for gap_s in gaps_s:
                latencies, server_mean_ms = _paced(
                    server.target, request, args.calls, gap_s, metrics
                )
                p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
                shown = "—" if server_mean_ms is None else f"{server_mean_ms:.2f}"
                print(
                    f"| {spec.name} | {gap_s * 1e3:g} ms | {p50:.2f} | {p90:.2f} | {p99:.2f} | "
                    f"{shown} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
