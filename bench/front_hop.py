"""What the front's hop costs a call: one worker reached directly against through HAProxy.

riskserve is started as `make serve` runs it (`RISKSERVE_FRONT=haproxy`, one worker on a Unix
socket behind HAProxy). perf_analyzer (batch-1 ModelInfer, closed loop) then loads, in turns,
the worker's own socket and the front's port, at each concurrency. Each row gives the rate,
perf_analyzer's p50 and p99, and the CPU per request of HAProxy and of the worker over the point
(their CPU time divided by the requests the worker's metrics counted; HAProxy's is 0 when it is
bypassed). The client shares the cores with both: compare rows of one run.

    .venv/bin/python -m bench.front_hop
    .venv/bin/python -m bench.front_hop --concurrency 1,4,16 --rounds 3
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import psutil

from bench.compare import RESULTS_DIR, riskserve_knobs, server_spec
from bench.model_io import DEMO_MODEL_PATH
from bench.perf_analyzer import PerfAnalyzer, PerfPlan
from bench.servers import ServerProcess, metric_sum, scrape_metrics

__all__ = ["main"]


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _parts(server: ServerProcess) -> tuple[psutil.Process, psutil.Process, str]:
    """HAProxy, the worker and the worker's socket, found under the served front."""
    children = psutil.Process(server.pid).children(recursive=True)
    proxies = [p for p in children if "haproxy" in p.name()]
    workers = [p for p in children if p not in proxies]
    if len(proxies) != 1 or len(workers) != 1:
        raise RuntimeError("expected one HAProxy and one worker under the front")
    config = Path(proxies[0].cmdline()[-1]).read_text()
    socket = re.search(r"unix@(\S+) proto h2", config)  # its gRPC port, not its call lane
    if socket is None:
        raise RuntimeError("the front's configuration names no gRPC Unix socket")
    return proxies[0], workers[0], socket.group(1)


def run(args: argparse.Namespace) -> list[dict]:
    spec = server_spec("riskserve-front", DEMO_MODEL_PATH, riskserve_knobs(args.budget_ms))
    metrics_port = int(spec.env["RISKSERVE_METRICS_PORT"])
    rows = []
    with ServerProcess(spec, RESULTS_DIR / "logs" / "front_hop.log") as server:
        proxy, worker, socket = _parts(server)
        targets = {"direct": f"unix:{socket}", "front": server.target}
        analyzers = {
            path: PerfAnalyzer(PerfPlan(target=target, window_s=args.window_s, windows=3))
            for path, target in targets.items()
        }
        try:
            analyzers["front"].run_point("concurrency", 4)  # warm both paths
            for _ in range(args.rounds):
                for concurrency in args.concurrency:
                    for path, analyzer in analyzers.items():
                        before = metric_sum(
                            scrape_metrics(metrics_port), "riskserve_requests_total"
                        )
                        proxy_s, worker_s = _cpu_s(proxy), _cpu_s(worker)
                        point = analyzer.run_point("concurrency", concurrency)
                        proxy_s, worker_s = _cpu_s(proxy) - proxy_s, _cpu_s(worker) - worker_s
                        after = metric_sum(scrape_metrics(metrics_port), "riskserve_requests_total")
                        requests = max(after - before, 1)
                        row = {
                            "path": path,
                            "callers": concurrency,
                            "rps": point.throughput_rps,
                            "p50_ms": point.p50_ms,
                            "p99_ms": point.p99_ms,
                            "haproxy_us": proxy_s / requests * 1e6,
                            "worker_us": worker_s / requests * 1e6,
                        }
                        print(_row(row), flush=True)
                        rows.append(row)
        finally:
            for analyzer in analyzers.values():
                analyzer.close()
    return rows


def _row(row: dict) -> str:
    return (
        f"| {row['path']} | {row['callers']} | {row['rps']:,.0f} | {row['p50_ms']:.2f} | "
        f"{row['p99_ms']:.2f} | {row['haproxy_us']:,.0f} | {row['worker_us']:,.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4]
    )
    parser.add_argument("--rounds", type=int, default=2, help="turns over every point")
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument(
        "--budget-ms",
        type=float,
        default=1000.0,
        help="riskserve's budget; the front queues a call for a quarter of it, so that a long "
        "one keeps a burst from being refused (perf_analyzer stops at its first error)",
    )
    args = parser.parse_args(argv)
    print(
        "| path | callers | req/s | p50 ms | p99 ms | HAProxy CPU µs / request "
        "| worker CPU µs / request |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
