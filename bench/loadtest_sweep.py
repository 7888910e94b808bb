"""`make loadtest`'s traffic mix at rising offered rates: the highest rate the service holds.

For each server configuration (one process, or one per core) a riskserve server is started on
127.0.0.1 with its defaults (tracing and metrics on), or for `floor` the do-nothing server
(bench.rpc_floor: a fixed score for every valid request, so the same mix measures what the
transport and locust cost on the machine before any scoring), or for `floor-engine` that
server running the model on each request's own rows and nothing else, then locust runs the load
test's own mix (loadtest/locustfile.py: Score with 4 to 64 history rows, ScoreBatch of 2 to 8,
long histories, ModelInfer, invalid requests) at each offered rate for `--duration-s`, on the
same machine, in `--locust-processes` locust processes (default one). Per rate it prints what locust
measured (requests, failures, p50, p99, each call timed from when its task was due), the
server's own p50 and p99 (the bounds of the buckets of its request-duration histogram they fall
in), its CPU per request (its whole process group, from /proc), locust's CPU per request and
the server's shed count, and at the end the highest offered rate with no failures and a locust
p99 within the budget: the figure the README's load-test default and claims come from.

    .venv/bin/python -m bench.loadtest_sweep --rates 100,200,400,600,800,1000 --duration-s 20

Locust is itself Python on the same cores, so at high rates it takes CPU from the server; its
latencies include its own scheduling, and its CPU per request includes its start.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench.rpc_floor import echo_spec
from bench.servers import ServerProcess, ServerSpec, free_port, metric_sum, scrape_metrics
from service.telemetry.stats import parse_stage_buckets

REPO = Path(__file__).resolve().parents[1]
LOCUST = REPO / ".venv" / "bin" / "locust"
RISKSERVE = REPO / ".venv" / "bin" / "riskserve"
RPS_PER_USER = 10
FLOOR = "floor"
FLOOR_ENGINE = "floor-engine"


@dataclass(frozen=True)
class Point:
    config: str
    offered_rps: float
    requests: int
    failures: int
    achieved_rps: float
    p50_ms: float
    p99_ms: float
    server_cpu_us_per_request: float
    shed: float
    # The server's own request time (its request-duration histogram, every method): the bucket
    # bound the p50 and p99 fall within.
    server_p50_ms: float = math.nan
    server_p99_ms: float = math.nan
    locust_cpu_us_per_request: float = math.nan
    # The server's engine time (its engine-duration histogram's sum) per request: how much of
    # its CPU the model itself took.
    server_engine_us_per_request: float = math.nan

    @property
    def clean(self) -> bool:
        return self.requests > 0 and self.failures == 0


def _spec(config: str, budget_ms: float) -> tuple[ServerSpec, int]:
    # The metrics ports of N processes are N consecutive ports from the first.
    port, metrics_port = free_port(), free_port()
    if config in (FLOOR, FLOOR_ENGINE):
        # It serves no metrics: the server columns stay empty.
        spec = echo_spec(port, engine=config == FLOOR_ENGINE)
        return replace(spec, name=config), metrics_port
    env = {
        "RISKSERVE_PORT": str(port),
        "RISKSERVE_METRICS_PORT": str(metrics_port),
        "RISKSERVE_BUDGET_MS": f"{budget_ms:g}",
        # Kept traces go nowhere in a benchmark; tracing itself stays on, as deployed.
        "RISKSERVE_TRACE_FILE": "none",
    }
    if config.endswith("-front"):  # as `make serve` runs it: the HAProxy front before them
        env["RISKSERVE_FRONT"] = "haproxy"
        env["RISKSERVE_FRONT_METRICS_PORT"] = "0"
    processes = config.removesuffix("-front").removesuffix("-gather")
    if processes != "1-process":
        env["RISKSERVE_PROCESSES"] = processes.split("-", 1)[0]  # "auto", or "2" of "2-processes"
    if config.removesuffix("-front").endswith("-gather"):
        env["RISKSERVE_GATHER_US"] = "1000"  # a batch started alone waits for company
    argv = (str(RISKSERVE), "serve", "--port", str(port))
    return ServerSpec(config, argv, port, "fraud-demo", env=env, cwd=REPO), metrics_port


def _locust(target: str, rate: float, duration_s: float, prefix: Path, processes: int) -> float:
    """One locust run; the CPU seconds it used (all its processes)."""
    users = max(1, round(rate / RPS_PER_USER))
    command = [
        str(LOCUST),
        "-f",
        str(REPO / "loadtest" / "locustfile.py"),
        "--headless",
        "--only-summary",
        "--host",
        target,
        "-u",
        str(users),
        "-r",
        str(users),
        "--rps-per-user",
        f"{rate / users:g}",
        "--run-time",
        f"{duration_s:g}s",
        "--csv",
        str(prefix),
    ]
    if processes > 1:
        # Its workers talk to its master on loopback, on a port of their own.
        port = str(free_port())
        command += ["--processes", str(processes), "--master-bind-host", "127.0.0.1"]
        command += ["--master-bind-port", port, "--master-port", port]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _aggregated(prefix: Path) -> dict[str, str]:
    with Path(f"{prefix}_stats.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("Name") == "Aggregated"]
    if not rows:
        raise RuntimeError(f"no Aggregated row in {prefix}_stats.csv")
    return rows[0]


def _number(row: dict[str, str], key: str) -> float:
    try:
        return float(row[key])
    except (KeyError, ValueError):
        return math.nan


def _processes(config: str) -> int:
    config = config.removesuffix("-front").removesuffix("-gather")
    if config in ("1-process", FLOOR, FLOOR_ENGINE):
        return 1
    if config == "auto":
        return len(os.sched_getaffinity(0)) or 1
    return int(config.split("-", 1)[0])


def _server_counts(metrics_port: int, processes: int) -> tuple[float, float, dict[float, float]]:
    """From one scrape of every server process (each serves metrics on its own port: the first
    on `metrics_port`, the next one up, and so on): the requests shed so far, the engine
    seconds so far, and the requests so far at or under each bound (s) of the request-duration
    histogram, summed over methods and models. NaN and no buckets where a scrape fails (a slow
    server, or the floor, which serves no metrics)."""
    shed = engine_s = 0.0
    buckets: dict[float, float] = {}
    try:
        for i in range(processes):
            text = scrape_metrics(metrics_port + i)
            shed += metric_sum(text, "riskserve_shed_total")
            engine_s += metric_sum(text, "riskserve_engine_duration_seconds_sum")
            requests = parse_stage_buckets(text).get("end_to_end")
            if requests is not None:
                for bound, count in zip(requests.upper_bounds_s, requests.cumulative, strict=True):
                    buckets[bound] = buckets.get(bound, 0.0) + count
    except Exception:
        return math.nan, math.nan, {}
    return shed, engine_s, buckets


def _bucket_quantile_ms(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The bound (ms) of the first bucket holding the `q` quantile of the requests between two
    scrapes; NaN when none were counted."""
    cumulative = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = cumulative[-1][1] if cumulative else 0.0
    if total <= 0:
        return math.nan
    return next(bound for bound, count in cumulative if count >= q * total) * 1e3


def sweep(
    config: str,
    rates: list[float],
    duration_s: float,
    budget_ms: float,
    locust_processes: int,
) -> list[Point]:
    spec, metrics_port = _spec(config, budget_ms)
    processes = _processes(config)
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="loadtest-sweep-") as tmp:
        log = Path(tmp) / f"{config}.log"
        with ServerProcess(spec, log) as server:
            # Connect and warm caches.
            _locust(server.target, min(rates), 3.0, Path(tmp) / "warm", locust_processes)
            for rate in rates:
                prefix = Path(tmp) / f"{config}-{rate:g}"
                cpu_before = server.cpu_seconds()
                shed_before, engine_before, buckets_before = _server_counts(metrics_port, processes)
                started = time.monotonic()
                locust_cpu_s = _locust(server.target, rate, duration_s, prefix, locust_processes)
                elapsed_s = time.monotonic() - started
                cpu_s = server.cpu_seconds() - cpu_before
                shed, engine_s, buckets = _server_counts(metrics_port, processes)
                row = _aggregated(prefix)
                requests = int(_number(row, "Request Count"))
                point = Point(
                    config,
                    rate,
                    requests,
                    int(_number(row, "Failure Count")),
                    requests / duration_s if requests else 0.0,
                    _number(row, "50%"),
                    _number(row, "99%"),
                    cpu_s * 1e6 / requests if requests else math.nan,
                    shed - shed_before,
                    _bucket_quantile_ms(buckets_before, buckets, 0.50),
                    _bucket_quantile_ms(buckets_before, buckets, 0.99),
                    locust_cpu_s * 1e6 / requests if requests else math.nan,
                    (engine_s - engine_before) * 1e6 / requests if requests else math.nan,
                )
                points.append(point)
                print(_line(point), f"({elapsed_s:.0f} s)", flush=True)
    return points


def _line(p: Point) -> str:
    return (
        f"  {p.config:<12} offered {p.offered_rps:>6g}/s  got {p.achieved_rps:>7.1f}/s  "
        f"failures {p.failures:>5} of {p.requests:>6}  p50 {p.p50_ms:>5g} ms  "
        f"p99 {p.p99_ms:>5g} ms  server p50 <= {p.server_p50_ms:g} ms, p99 <= "
        f"{p.server_p99_ms:g} ms, {p.server_cpu_us_per_request:>5.0f} us CPU/req (engine "
        f"{p.server_engine_us_per_request:.0f})  shed {p.shed:g}  "
        f"locust {p.locust_cpu_us_per_request:>5.0f} us CPU/req"
    )


def _server_quantiles(p: Point) -> str:
    if math.isnan(p.server_p50_ms):
        return "—"
    return f"≤ {p.server_p50_ms:g} / ≤ {p.server_p99_ms:g}"


def _us(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:,.0f} µs"


def report(points: list[Point], budget_ms: float) -> None:
    print()
    print(
        "| server | offered req/s | failures | locust p50 ms | locust p99 ms "
        "| server p50 / p99 ms (bucket bound) | server CPU / request | of it the engine "
        "| locust CPU / request |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in points:
        print(
            f"| {p.config} | {p.offered_rps:g} | {p.failures:,} of {p.requests:,} | {p.p50_ms:g} | "
            f"{p.p99_ms:g} | {_server_quantiles(p)} | "
            f"{p.server_cpu_us_per_request:,.0f} µs | {_us(p.server_engine_us_per_request)} | "
            f"{p.locust_cpu_us_per_request:,.0f} µs |"
        )
    print()
    for config in dict.fromkeys(p.config for p in points):
        held = [
            p.offered_rps
            for p in points
            if p.config == config and p.clean and p.p99_ms <= budget_ms
        ]
        best = f"{max(held):g} req/s" if held else "none of the rates"
        print(f"{config}: highest offered rate with 0 failures and p99 <= {budget_ms:g} ms: {best}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", default="100,200,400,600,800,1000", help="req/s, comma-separated"
    )
    parser.add_argument("--duration-s", type=float, default=20.0, help="per rate")
    parser.add_argument("--budget-ms", type=float, default=10.0)
    parser.add_argument(
        "--configs",
        default="1-process,auto",
        help="1-process, auto (one per core) or N-processes (RISKSERVE_PROCESSES=N), each "
        "with -gather appended for RISKSERVE_GATHER_US=1000 and then -front for the HAProxy "
        "front before the processes (RISKSERVE_FRONT=haproxy), floor (the do-nothing server) or "
        "floor-engine (it running the model on each request alone); comma-separated",
    )
    parser.add_argument(
        "--locust-processes", type=int, default=1, help="locust processes (its --processes)"
    )
    args = parser.parse_args(argv)
    rates = sorted(float(r) for r in args.rates.split(",") if r)
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"make loadtest's mix by locust on this machine ({os.cpu_count()} cores, load average "
        f"{load}); {args.duration_s:g} s a rate; {args.locust_processes} locust process(es); "
        f"budget {args.budget_ms:g} ms"
    )
    points: list[Point] = []
    for config in args.configs.split(","):
        points += sweep(
            config,
            rates,
            args.duration_s,
            args.budget_ms,
            args.locust_processes,
        )
    report(points, args.budget_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
