"""Instructions a riskserve server executes per request, counted by callgrind.

Timing on a shared two-core VM moves by several percent from one minute to the next, more than
the features compared here cost. Valgrind's callgrind counts the instructions a process
executes instead, a count the machine's speed does not change. Each named single-process
server (the `bench.compare` names: riskserve, riskserve-notrace, riskserve-nobatch) runs
under callgrind with counting off; perf_analyzer warms it, then counting is switched on for a
closed-loop run of `--seconds` at `--concurrency`, and off again. The count, divided by the
requests the server's own metrics counted over the same span, is its instructions per request.
Servers take turns, `--runs` times. Under valgrind a server runs over a hundred times slower,
so a run answers a few hundred requests. Two runs of one server differ by about 1 %: the count
includes the idle threads, and how many requests each wake-up of the event loop handles
depends on when they arrive; other work on the machine changes that (a run beside a profiler
came out 5.6 % high), so run it on an otherwise idle machine.

    .venv/bin/python -m bench.instructions --servers riskserve,riskserve-notrace --runs 2
    .venv/bin/python -m bench.instructions --servers riskserve --concurrency 16 --streaming
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

from bench import callgrind
from bench.compare import RESULTS_DIR, riskserve_knobs, server_spec
from bench.model_io import resolve_model_path
from bench.perf_analyzer import PerfAnalyzer, PerfPlan
from bench.servers import ServerProcess, metric_sum, scrape_metrics


def requests_served(metrics_port: int) -> float:
    """Requests the server has answered, by its Prometheus counter (all statuses)."""
    # A server under valgrind answers a scrape slowly.
    return metric_sum(scrape_metrics(metrics_port, timeout_s=30.0), "riskserve_requests_total")


def count_one(name: str, args: argparse.Namespace, run: int) -> tuple[int, float]:
    """Instructions and requests of one counted span of server `name`."""
    onnx_path = resolve_model_path(None)
    knobs = riskserve_knobs(args.riskserve_budget_ms)
    spec = server_spec(name, onnx_path, knobs)
    if not name.startswith("riskserve") or spec.env.get("RISKSERVE_PROCESSES", "1") != "1":
        # Callgrind follows one process: a peer's or a forked worker's work would go uncounted.
        raise ValueError(f"{name}: only single-process riskserve servers can be counted")
    out_file = RESULTS_DIR / "callgrind" / f"{name}-{run}.out"
    spec = callgrind.under_callgrind(spec, out_file)
    metrics_port = int(spec.env["RISKSERVE_METRICS_PORT"])
    log_path = RESULTS_DIR / "logs" / f"instructions-{name}-{run}.log"
    with ServerProcess(spec, log_path) as server:
        # perf_analyzer may find the slowed server's windows unstable and say so; the requests
        # still ran, and the server's own counter is what is used.
        warm = PerfPlan(target=server.target, window_s=5.0, windows=1, streaming=args.streaming)
        with PerfAnalyzer(warm, onnx_path, server_label=name) as warmer:
            warmer.run_point("concurrency", args.concurrency)
        plan = PerfPlan(
            target=server.target, window_s=args.seconds, windows=1, streaming=args.streaming
        )
        with PerfAnalyzer(plan, onnx_path, server_label=name) as analyzer:
            before = requests_served(metrics_port)
            callgrind.control(server.pid, "-i", "on")
            analyzer.run_point("concurrency", args.concurrency)
            callgrind.control(server.pid, "-i", "off")
            served = requests_served(metrics_port) - before
        server.stop(grace_s=callgrind.STOP_GRACE_S)
    return callgrind.total(out_file), served


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="riskserve,riskserve-notrace")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0, help="counted span per run")
    parser.add_argument("--riskserve-budget-ms", type=float, default=1000.0)
    parser.add_argument(
        "--streaming", action="store_true", help="perf_analyzer sends on ModelStreamInfer"
    )
    args = parser.parse_args(argv)
    missing = callgrind.missing_tools()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    per_request: dict[str, list[float]] = {name: [] for name in names}
    for run in range(args.runs):
        for name in names if run % 2 == 0 else names[::-1]:
            instructions, served = count_one(name, args, run)
            if served <= 0:
                print(f"run {run + 1} {name}: no requests counted", flush=True)
                continue
            per_request[name].append(instructions / served)
            print(
                f"run {run + 1} {name:20} {instructions / 1e6:9.1f} M instructions, "
                f"{served:6.0f} requests: {instructions / served / 1e6:.3f} M a request",
                flush=True,
            )
    base = names[-1]
    print(f"\n| server | M instructions per request, run by run | median | against {base} |")
    print("|---|---|---:|---:|")
    for name in names:
        values = per_request[name]
        if not values:
            print(f"| {name} | no requests counted | | |")
            continue
        median = statistics.median(values)
        against = ""
        if name != base and per_request[base]:
            against = f"{(median / statistics.median(per_request[base]) - 1) * 100:+.1f} %"
        runs = ", ".join(f"{v / 1e6:.3f}" for v in values)
        print(f"| {name} | {runs} | {median / 1e6:.3f} | {against} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
