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
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.compare import RESULTS_DIR, riskserve_knobs, server_spec
from bench.model_io import resolve_model_path
from bench.perf_analyzer import PerfAnalyzer, PerfPlan
from bench.servers import ServerProcess, metric_sum, scrape_metrics

_TOTALS = re.compile(r"^(?:totals|summary):\s+(\d+)", re.MULTILINE)


def requests_served(metrics_port: int) -> float:
    """Requests the server has answered, by its Prometheus counter (all statuses)."""
    # A server under valgrind answers a scrape slowly.
    return metric_sum(scrape_metrics(metrics_port, timeout_s=30.0), "riskserve_requests_total")


def callgrind_total(out_file: Path) -> int:
    """The instruction total callgrind wrote for the counted span."""
    found = _TOTALS.findall(out_file.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"no totals in {out_file}")
    return int(found[-1])


def count_one(name: str, args: argparse.Namespace, run: int) -> tuple[int, float]:
    """Instructions and requests of one counted span of server `name`."""
    onnx_path = resolve_model_path(None)
    knobs = riskserve_knobs(args.riskserve_budget_ms)
    spec = server_spec(name, onnx_path, knobs)
    if not name.startswith("riskserve") or spec.env.get("RISKSERVE_PROCESSES", "1") != "1":
        # Callgrind follows one process: a peer's or a forked worker's work would go uncounted.
        raise ValueError(f"{name}: only single-process riskserve servers can be counted")
    out_file = RESULTS_DIR / "callgrind" / f"{name}-{run}.out"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.unlink(missing_ok=True)
    valgrind = (
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_file}",
    )
    # The riskserve script is a Python entry point: run its module under valgrind directly.
    python = Path(spec.argv[0]).with_name("python")
    argv = (*valgrind, str(python), "-m", "service", *spec.argv[1:])
    spec = replace(spec, argv=argv, startup_timeout_s=900.0)
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
            _callgrind_control("on", server.pid)
            analyzer.run_point("concurrency", args.concurrency)
            _callgrind_control("off", server.pid)
            served = requests_served(metrics_port) - before
        # Callgrind writes its file as the process exits; a slowed shutdown needs the time.
        server.stop(grace_s=300.0)
    return callgrind_total(out_file), served


def _callgrind_control(state: str, pid: int) -> None:
    done = subprocess.run(
        ["callgrind_control", "-i", state, str(pid)], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise RuntimeError(f"callgrind_control -i {state} {pid}: {done.stdout}{done.stderr}")


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
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
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
    for name in names:
        values = per_request[name]
        if not values:
            continue
        median = statistics.median(values)
        spread = (max(values) / min(values) - 1) * 100
        line = f"{name:20} median {median / 1e6:.3f} M a request (runs differ by {spread:.1f} %)"
        if name != base and per_request[base]:
            ratio = median / statistics.median(per_request[base])
            line += f", {(ratio - 1) * 100:+.1f} % against {base}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
