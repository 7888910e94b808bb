"""Where a request's server CPU goes, with batching on and off: RPC layer, handoff, engine.

For each configuration a riskserve process serves the demo model; perf_analyzer (closed loop,
OIP, a C++ client that takes little of the shared CPU) drives it at a fixed concurrency. From
the server's process CPU time, its own Prometheus histograms (engine seconds, batch sizes,
requests) and a microbenchmark of the batcher's hand-off, it prints per request:

- engine: engine seconds summed over batches / requests (ONNX Runtime runs single-threaded, so
  its wall time is its CPU time, plus any wait for a core on a loaded machine);
- handoff: batches / requests x one round trip of an empty batch through a MicroBatcher (queue,
  engine thread, result back on the event loop) plus merging the rows of a batch;
- RPC layer and the rest: everything else the server process spent (gRPC, protobuf, the
  servicer, validation, the batcher's bookkeeping, telemetry).

    .venv/bin/python -m bench.cpu_breakdown --concurrency 16 --duration-s 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.perf_analyzer import PerfAnalyzer, PerfPlan
from bench.servers import ServerProcess, ServerSpec, free_port, metric_sum, scrape_metrics

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


@dataclass(frozen=True)
class Breakdown:
    config: str
    requests: int
    throughput_rps: float
    p99_ms: float
    mean_batch_rows: float
    cpu_us_per_request: float
    engine_us_per_request: float
    handoff_us_per_request: float
    rpc_and_rest_us_per_request: float


def handoff_cost_s(rows: int, repeats: int = 3000) -> float:
    """One request's trip through a MicroBatcher whose engine does nothing, plus merging."""
    from demo.generator import generate, model_inputs
    from service.batching.batcher import BatchOutcome, MicroBatcher, merge
    from service.batching.rows import RowBatch

    data = model_inputs(generate(rows, seed=1))
    batches = [
        RowBatch(
            data["features"][i : i + 1],
            data["history"][i : i + 1, :32],
            data["history_mask"][i : i + 1, :32],
        )
        for i in range(rows)
    ]
    scores = np.zeros(1, dtype=np.float32)

    def run_nothing(batch: RowBatch) -> BatchOutcome:
        return BatchOutcome(scores, "none", "", 0.0)

    async def run() -> float:
        batcher = MicroBatcher(run_nothing, max_batch_rows=1, max_queue_rows=8, workers=1)
        batcher.start()
        start = time.perf_counter()
        for _ in range(repeats):
            await batcher.submit(batches[0], time.monotonic() + 1.0)
        trip_s = (time.perf_counter() - start) / repeats
        await batcher.close(1.0)
        return trip_s

    merge_s = 0.0
    if rows > 1:
        start = time.perf_counter()
        for _ in range(repeats):
            merge(batches)
        merge_s = (time.perf_counter() - start) / repeats
    return asyncio.run(run()) + merge_s


def measure(config: str, env: dict[str, str], args: argparse.Namespace) -> Breakdown:
    port, metrics_port = free_port(), free_port()
    spec = ServerSpec(
        name=config,
        argv=(str(REPO / ".venv" / "bin" / "riskserve"), "serve", "--port", str(port)),
        grpc_port=port,
        model_name="fraud-demo",
        env={
            "RISKSERVE_METRICS_PORT": str(metrics_port),
            "RISKSERVE_TRACE_FILE": "none",
            "RISKSERVE_ONNX_VARIANTS": "false",
            "RISKSERVE_BUDGET_MS": str(args.budget_ms),
            **env,
        },
        cwd=REPO,
    )
    plan = PerfPlan(target=f"127.0.0.1:{port}", window_s=args.duration_s / 3, windows=3)
    log_path = RESULTS / f"cpu_breakdown_{config}.log"
    with ServerProcess(spec, log_path) as server, PerfAnalyzer(plan, server_label=config) as load:
        load.run_point("concurrency", 4)  # warm-up
        before_text, before_cpu = scrape_metrics(metrics_port), server.cpu_seconds()
        point = load.run_point("concurrency", args.concurrency)
        after_text, after_cpu = scrape_metrics(metrics_port), server.cpu_seconds()

    def delta(name: str) -> float:
        return metric_sum(after_text, name) - metric_sum(before_text, name)

    requests = delta("riskserve_request_duration_seconds_count")
    batches = delta("riskserve_batch_size_count")
    rows = delta("riskserve_batch_size_sum")
    engine_s = delta("riskserve_engine_duration_seconds_sum")
    mean_rows = rows / batches if batches else float("nan")
    handoff_s = handoff_cost_s(max(1, round(mean_rows))) * batches
    cpu_s = after_cpu - before_cpu
    return Breakdown(
        config=config,
        requests=int(requests),
        throughput_rps=point.throughput_rps,
        p99_ms=point.p99_ms,
        mean_batch_rows=mean_rows,
        cpu_us_per_request=cpu_s / requests * 1e6,
        engine_us_per_request=engine_s / requests * 1e6,
        handoff_us_per_request=handoff_s / requests * 1e6,
        rpc_and_rest_us_per_request=(cpu_s - engine_s - handoff_s) / requests * 1e6,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration-s", type=float, default=6.0)
    parser.add_argument(
        "--budget-ms",
        type=float,
        default=1000.0,
        help="server budget: generous, so shedding does not skew the split",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "cpu_breakdown.json")
    args = parser.parse_args(argv)
    configs = {
        "batching-on": {},
        "batching-off": {"RISKSERVE_MAX_BATCH_SIZE": "1"},
    }
    results = [measure(name, env, args) for name, env in configs.items()]
    # The PerfAnalyzer point sees only its measurement windows; the CPU and the counters cover
    # the whole perf_analyzer run, so both sides of each ratio count the same requests.
    header = (
        "config",
        "req/s",
        "p99 ms",
        "rows/batch",
        "CPU us/req",
        "engine",
        "handoff",
        "RPC+rest",
    )
    print(" | ".join(header))
    for r in results:
        print(
            f"{r.config} | {r.throughput_rps:.0f} | {r.p99_ms:.2f} | {r.mean_batch_rows:.1f} | "
            f"{r.cpu_us_per_request:.0f} | {r.engine_us_per_request:.0f} | "
            f"{r.handoff_us_per_request:.0f} | {r.rpc_and_rest_us_per_request:.0f}"
        )
    on, off = results
    print(
        f"engine time per request, off / on: "
        f"{off.engine_us_per_request / on.engine_us_per_request:.2f}x"
    )
    print(
        f"server CPU per request, off / on: {off.cpu_us_per_request / on.cpu_us_per_request:.2f}x"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
