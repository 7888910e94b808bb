"""What the client waits for against what riskserve's handler measures, rate by rate.

perf_analyzer (open loop, Poisson arrivals, OIP) drives one riskserve server at each rate; the
server's own histograms, scraped before and after each point, give its percentiles of the
time from the handler's start to its return (end to end), of queue wait and of engine time.
The client's latency also holds what happens before the handler starts and after it returns:
the request's bytes through gRPC's core and its threads, the wait for the event loop to take up
the call (the loop's backlog), serialization of the response and the client's own work.

Percentiles do not subtract: the client's p50 less the handler's p50 is a fair reading of the
fixed cost outside the handler, but a p99 is compared side by side only. The server's figures
come from histogram buckets (interpolated as Prometheus does; 0.25 to 1 ms wide around a few
ms) and cover perf_analyzer's whole run at a rate, its start included, where the client's
cover its measurement windows only.

With `--floor`, each round first drives a grpc.aio server that answers ModelInfer with zero
scores and does nothing else (`bench.rpc_floor`'s) at the same rates: its client latency is
what gRPC's Python server and the client cost with no work at all.

    .venv/bin/python -m bench.latency_split --rates 200,400,600,800,1000 --rounds 3 --floor
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.compare import RESULTS_DIR, riskserve_knobs, server_spec
from bench.model_io import resolve_model_path
from bench.perf_analyzer import PerfAnalyzer, PerfPlan
from bench.results import floats
from bench.rpc_floor import echo_spec
from bench.servers import ServerProcess, free_port, scrape_metrics
from service.telemetry.stats import stats_from_scrapes

FLOOR = "floor"


@dataclass(frozen=True)
class Split:
    server: str
    round: int
    rate_rps: float
    throughput_rps: float
    client_p50_ms: float
    client_p99_ms: float
    handler_p50_ms: float
    handler_p99_ms: float
    queue_p99_ms: float
    engine_p99_ms: float
    server_cpu_ms_per_request: float

    @property
    def outside_p50_ms(self) -> float:
        return self.client_p50_ms - self.handler_p50_ms


def measure_round(round_no: int, name: str, args: argparse.Namespace) -> list[Split]:
    """One fresh server (`riskserve`, or `floor`: a grpc.aio server that does no work), every
    rate in turn. The floor has no histograms: its handler figures are NaN."""
    if name == FLOOR:
        spec, metrics_port = echo_spec(free_port()), None
    else:
        knobs = riskserve_knobs(args.budget_ms)
        spec = server_spec("riskserve", resolve_model_path(None), knobs)
        spec.env.update(args.env)
        metrics_port = int(spec.env["RISKSERVE_METRICS_PORT"])
    plan = PerfPlan(target=f"127.0.0.1:{spec.grpc_port}", window_s=args.window_s)
    splits = []
    log_path = RESULTS_DIR / f"latency_split_{name}_round{round_no}.log"
    with ServerProcess(spec, log_path) as server, PerfAnalyzer(plan) as load:
        load.run_point("rate", args.rates[0])  # warm-up
        for rate in args.rates:
            started = time.monotonic()
            before = "" if metrics_port is None else scrape_metrics(metrics_port)
            cpu_before = server.cpu_seconds()
            point = load.run_point("rate", rate)
            cpu_after = server.cpu_seconds()
            after = "" if metrics_port is None else scrape_metrics(metrics_port)
            stats = stats_from_scrapes(before, after, time.monotonic() - started)
            stage = {s.stage: s for s in stats.stages}
            handled = stage["end_to_end"].count
            splits.append(
                Split(
                    server=name,
                    round=round_no,
                    rate_rps=rate,
                    throughput_rps=point.throughput_rps,
                    client_p50_ms=point.p50_ms,
                    client_p99_ms=point.p99_ms,
                    handler_p50_ms=stage["end_to_end"].p50_ms,
                    handler_p99_ms=stage["end_to_end"].p99_ms,
                    queue_p99_ms=stage["queue"].p99_ms,
                    engine_p99_ms=stage["engine"].p99_ms,
                    server_cpu_ms_per_request=(
                        (cpu_after - cpu_before) * 1e3 / handled if handled else math.nan
                    ),
                )
            )
            print(_row(splits[-1]), flush=True)
    return splits


_HEADER = (
    "server | round | rate | req/s | client p50 | client p99 | handler p50 | handler p99 | "
    "queue p99 | engine p99 | outside p50 | CPU ms/req"
)


def _row(s: Split) -> str:
    return (
        f"{s.server} | {s.round} | {s.rate_rps:g} | {s.throughput_rps:.0f} | "
        f"{s.client_p50_ms:.2f} | {s.client_p99_ms:.2f} | "
        f"{s.handler_p50_ms:.2f} | {s.handler_p99_ms:.2f} | "
        f"{s.queue_p99_ms:.2f} | {s.engine_p99_ms:.2f} | {s.outside_p50_ms:.2f} | "
        f"{s.server_cpu_ms_per_request:.3f}"
    )


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates",
        type=floats,
        default=[200.0, 400.0, 600.0, 800.0, 1000.0],
        help="req/s, comma-separated",
    )
    parser.add_argument("--rounds", type=int, default=3, help="fresh servers, one after another")
    parser.add_argument("--window-s", type=float, default=2.0, help="perf_analyzer window")
    parser.add_argument(
        "--budget-ms", type=float, default=1000.0, help="server budget: no shedding by default"
    )
    parser.add_argument(
        "--env", type=_env_pair, action="append", default=[], help="NAME=VALUE for the server"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="each round, first drive a grpc.aio server that does no work at the same rates",
    )
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "latency_split.json")
    args = parser.parse_args(argv)
    args.env = dict(args.env)

    print(_HEADER)
    servers = [FLOOR, "riskserve"] if args.floor else ["riskserve"]
    splits = [
        s
        for n in range(1, args.rounds + 1)
        for name in servers
        for s in measure_round(n, name, args)
    ]
    print("\nmedians over rounds")
    print(_HEADER.replace("round", "rounds"))
    for name in servers:
        for rate in args.rates:
            at_rate = [s for s in splits if s.server == name and s.rate_rps == rate]
            medians = {
                field: statistics.median(getattr(s, field) for s in at_rate)
                for field in asdict(at_rate[0])
                if field not in ("server", "round", "rate_rps")
            }
            print(_row(Split(server=name, round=len(at_rate), rate_rps=rate, **medians)))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([asdict(s) for s in splits], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
