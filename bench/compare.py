"""riskserve against Triton and MLServer on the same ONNX model, the same tensors, one machine.

For each server in turn: start it on 127.0.0.1, warm it, run the sweep with the chosen client,
stop it. Then print a table, the ratios riskserve / peer of the highest rate whose p99 meets
the budget (with at most the allowed error rate) and of p99 at a common rate, write the points
as JSON under bench/results/, and draw latency against achieved throughput as a PNG.

Servers: ``riskserve`` (batching on), ``riskserve-nobatch`` (RISKSERVE_MAX_BATCH_SIZE=1),
``triton``, ``mlserver``; also, on request, ``riskserve-notrace`` (RISKSERVE_TRACING=false),
``riskserve-2proc`` (two server processes on one port), ``riskserve-front`` (as ``make serve``
runs it: the HAProxy front before one worker, RISKSERVE_FRONT=haproxy), ``riskserve-threaded``
(every batch on an engine thread, RISKSERVE_ENGINE_INLINE_MAX_US=0), ``riskserve-si500`` and
``riskserve-threaded-si500`` (the same with RISKSERVE_SWITCH_INTERVAL_US=500),
``riskserve-gather`` (a batch started alone waits up to 1 ms for company,
RISKSERVE_GATHER_US=1000),
``grpc-floor``: one grpc.aio server
process that answers ModelInfer with zeros and does no other work (bench.rpc_floor), so a run
shows how much of a peer's lead a Python gRPC server gives away before it does any work,
``grpc-floor-sync``: the same on gRPC's thread-pool server, and ``grpc-floor-engine``: the
grpc.aio one running the model on each request's rows and nothing else.
Clients: ``loadgen`` (Python, open-loop Poisson and closed loop) or ``perf_analyzer`` (C++,
lower CPU; MLServer lacks the ModelConfig call it needs, so MLServer falls back to loadgen and
its rows say so). The client shares the cores with the server.

    .venv/bin/python -m bench.compare --servers triton,mlserver --rates 250,500,1000,1500 \
        --duration-s 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.loadgen import LoadGenerator, LoadPlan
from bench.model_io import (
    DEMO_MODEL_PATH,
    REPO_ROOT,
    resolve_model_path,
    write_standin_models_dir,
)
from bench.peers.mlserver.launch import MLServerConfig, mlserver_spec
from bench.peers.triton import TritonConfig, triton_spec
from bench.results import PointResult, best_rate_under_budget, floats
from bench.rpc_floor import echo_spec
from bench.servers import ServerProcess, ServerSpec, free_port

__all__ = ["main"]

RESULTS_DIR = REPO_ROOT / "bench" / "results"
WORK_DIR = REPO_ROOT / "bench" / ".peers" / "work"
RISKSERVE_BIN = REPO_ROOT / ".venv" / "bin" / "riskserve"
PEERS = ("triton", "mlserver")
FLOOR = "grpc-floor"
FLOOR_SYNC = "grpc-floor-sync"
FLOOR_ENGINE = "grpc-floor-engine"
FLOOR_LANE = "grpc-floor-lane"
FLOORS = (FLOOR, FLOOR_SYNC, FLOOR_ENGINE, FLOOR_LANE)
ALL_SERVERS = ("riskserve", "riskserve-nobatch", *PEERS)


@dataclass(frozen=True)
class Knobs:
    """Batching settings given to every server, as close to each other as their knobs allow."""

    max_batch_size: int
    triton_queue_delay_us: int
    mlserver_batch_time_s: float
    intra_op_threads: int
    riskserve_budget_ms: float | None = None


DEFAULT_KNOBS = Knobs(
    max_batch_size=64, triton_queue_delay_us=200, mlserver_batch_time_s=0.0005, intra_op_threads=1
)


def riskserve_knobs(budget_ms: float | None) -> Knobs:
    """This harness's default settings, for benchmarks that start only riskserve servers."""
    return replace(DEFAULT_KNOBS, riskserve_budget_ms=budget_ms)


class Skip(Exception):
    """A server that cannot run here; the reason is printed and the comparison goes on."""


def _riskserve_spec(name: str, onnx_path: Path, knobs: Knobs) -> ServerSpec:
    if not RISKSERVE_BIN.exists():
        raise Skip(f"{RISKSERVE_BIN.relative_to(REPO_ROOT)} is not installed yet")
    probe = subprocess.run(
        [str(RISKSERVE_BIN), "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        raise Skip("`riskserve serve --help` fails: the serve command is not there yet")
    if onnx_path == DEMO_MODEL_PATH:
        models_dir = "models"
    else:
        # No demo model yet (or another ONNX file): serve it from a stand-in models folder.
        models_dir = str(write_standin_models_dir(onnx_path))
    port = free_port()
    env = {
        "RISKSERVE_MODELS_DIR": models_dir,
        "RISKSERVE_PORT": str(port),
        "RISKSERVE_METRICS_PORT": str(free_port()),
        # The peers run the FP32 file: riskserve does too, whatever its pool measures fastest.
        "RISKSERVE_ONNX_VARIANTS": "false",
        # Kept traces go nowhere in a benchmark; tracing itself stays on, as deployed.
        "RISKSERVE_TRACE_FILE": "none",
        # With a 1 s budget an overloaded point holds far more calls open than the deployed
        # limit of 100 a connection; refusing them would end perf_analyzer's sweep with an
        # error where the peers (no such limit) report their latency. Measure it instead.
        "RISKSERVE_MAX_CONCURRENT_STREAMS": "10000",
    }
    if knobs.riskserve_budget_ms is not None:
        env["RISKSERVE_BUDGET_MS"] = f"{knobs.riskserve_budget_ms:g}"
    if name in ("riskserve-nobatch", "riskserve-front-nobatch"):
        env["RISKSERVE_MAX_BATCH_SIZE"] = "1"
    else:
        env["RISKSERVE_MAX_BATCH_SIZE"] = str(knobs.max_batch_size)
    if name == "riskserve-notrace":
        env["RISKSERVE_TRACING"] = "false"
    if name == "riskserve-2proc":
        env["RISKSERVE_PROCESSES"] = "2"
    if name.startswith("riskserve-front"):  # as `make serve` and the image run it
        env["RISKSERVE_FRONT"] = "haproxy"
        env["RISKSERVE_FRONT_METRICS_PORT"] = "0"
    if name.startswith("riskserve-threaded"):
        env["RISKSERVE_ENGINE_INLINE_MAX_US"] = "0"
    if name.endswith("-si500"):
        env["RISKSERVE_SWITCH_INTERVAL_US"] = "500"
    if name == "riskserve-gather":
        env["RISKSERVE_GATHER_US"] = "1000"
    return ServerSpec(
        name=name,
        argv=(str(RISKSERVE_BIN), "serve", "--port", str(port)),
        grpc_port=port,
        model_name="fraud-demo",
        env=env,
        cwd=REPO_ROOT,
    )


def server_spec(name: str, onnx_path: Path, knobs: Knobs) -> ServerSpec:
    """How to launch `name`; raises Skip when it cannot run on this checkout."""
    if name.startswith("riskserve"):
        return _riskserve_spec(name, onnx_path, knobs)
    if name == "triton":
        config = TritonConfig(
            max_batch_size=knobs.max_batch_size,
            max_queue_delay_microseconds=knobs.triton_queue_delay_us,
            intra_op_num_threads=knobs.intra_op_threads,
        )
        return triton_spec(onnx_path, WORK_DIR / "triton", config, free_port())
    if name in FLOORS:
        spec = echo_spec(
            free_port(),
            sync=name == FLOOR_SYNC,
            engine=name == FLOOR_ENGINE,
            lane=name == FLOOR_LANE,
        )
        return replace(spec, name=name)
    if name == "mlserver":
        mlserver = MLServerConfig(
            max_batch_size=knobs.max_batch_size,
            max_batch_time_s=knobs.mlserver_batch_time_s,
            intra_op_num_threads=knobs.intra_op_threads,
        )
        return mlserver_spec(onnx_path, WORK_DIR / "mlserver", mlserver, free_port())
    raise ValueError(f"unknown server {name!r}; known: {', '.join((*ALL_SERVERS, *FLOORS))}")


def _run_one(name: str, args: argparse.Namespace, onnx_path: Path, knobs: Knobs) -> dict:
    """Starts, warms, sweeps and stops one server; returns its record for the JSON file."""
    record: dict = {"server": name, "load_average_before": os.getloadavg()}
    try:
        spec = server_spec(name, onnx_path, knobs)
    except (Skip, FileNotFoundError) as exc:
        print(f"[{name}] skipped: {exc}")
        return {**record, "skipped": str(exc), "points": []}
    log_path = RESULTS_DIR / "logs" / f"{name}.log"
    plan = LoadPlan.from_args(args, "", spec.model_name)
    client = args.client
    if client == "perf_analyzer" and not spec.supports_model_config:
        print(f"[{name}] has no ModelConfig RPC, which perf_analyzer needs: using loadgen")
        client = "loadgen"
    try:
        with ServerProcess(spec, log_path) as server:
            print(f"[{name}] ready on {server.target} after {server.startup_s:.1f} s")
            plan = LoadPlan(**{**plan.__dict__, "target": server.target})
            with LoadGenerator(plan, onnx_path, server_label=name) as generator:
                score = float(generator.warm_up()[0, 0])
                record["warmup_score"] = score
                print(f"[{name}] warm; score of the benchmark request {score:.6f}")
                if client == "perf_analyzer":
                    points = _perf_sweep(
                        name, server.target, args, onnx_path, spec.model_name, server.cpu_seconds
                    )
                else:
                    points = generator.sweep(
                        args.rates,
                        args.concurrency,
                        args.budget_ms,
                        args.max_error_rate,
                        args.stop_after_failures,
                        server_cpu=server.cpu_seconds,
                    )
    except RuntimeError as exc:
        print(f"[{name}] failed: {exc}")
        return {**record, "skipped": str(exc), "points": []}
    return {**record, "client": client, "points": [p.as_dict() for p in points]}


def _perf_sweep(
    name: str,
    target: str,
    args: argparse.Namespace,
    onnx_path: Path,
    model_name: str,
    server_cpu: Callable[[], float],
) -> list[PointResult]:
    from bench.perf_analyzer import PerfAnalyzer, PerfPlan

    windows = 3
    plan = PerfPlan(
        target=target,
        model_name=model_name,
        history_len=args.history_len,
        window_s=args.duration_s / windows,
        windows=windows,
    )
    with PerfAnalyzer(plan, onnx_path, server_label=name) as analyzer:
        return analyzer.sweep(
            args.rates,
            args.concurrency,
            args.budget_ms,
            args.max_error_rate,
            args.stop_after_failures,
            server_cpu=server_cpu,
        )


def _points(record: dict) -> list[PointResult]:
    return [PointResult.from_dict(p) for p in record["points"]]


def _at_rate(points: Sequence[PointResult], rate: float) -> PointResult | None:
    return next((p for p in points if p.mode == "rate" and p.load == rate), None)


def _cpu_ms_per_ok(point: PointResult | None) -> float:
    if point is None or not point.ok or not math.isfinite(point.server_cpu_s):
        return math.nan
    return point.server_cpu_s * 1e3 / point.ok


def _common_rate(records: Sequence[dict], requested: float | None) -> float | None:
    """The requested rate; else the highest rate offered to every measured server at which each
    answered at least 99 % of requests (a finite p99); else the lowest rate offered to all."""
    if requested is not None:
        return requested
    measured = [_points(r) for r in records if r["points"]]
    if not measured:
        return None
    offered = set.intersection(*({p.load for p in ps if p.mode == "rate"} for ps in measured))
    answered = [
        rate
        for rate in offered
        if all(
            (point := _at_rate(ps, rate)) is not None and math.isfinite(point.p99_ms)
            for ps in measured
        )
    ]
    if answered:
        return max(answered)
    return min(offered) if offered else None


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a" if value is None or math.isnan(value) else "inf"
    return f"{value:,.1f}{unit}" if unit != " req/s" else f"{value:,.0f}{unit}"


def _fmt3(value: float | None) -> str:
    return f"{value:.3f}" if value is not None and math.isfinite(value) else "n/a"


def print_points(records: Sequence[dict]) -> None:
    """Every point of every server, one row each: the table docs/benchmarks.md shows."""
    print()
    print("| server | load | req/s | errors | p50 ms | p99 ms | server CPU ms / request |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for record in records:
        for p in _points(record):
            load = f"c={p.load:g}" if p.mode == "concurrency" else f"{p.load:g} req/s"
            print(
                f"| {p.server} | {load} | {p.throughput_rps:,.0f} | {p.errors} | {p.p50_ms:.2f} "
                f"| {p.p99_ms:.2f} | {_cpu_ms_per_ok(p):.2f} |"
            )


def summarize(records: Sequence[dict], args: argparse.Namespace) -> dict:
    """Per-server headline figures and riskserve / peer ratios; printed and returned."""
    common = _common_rate(records, args.common_rate)
    rows = {}
    for record in records:
        if not record["points"]:
            continue
        points = _points(record)
        best = best_rate_under_budget(points, args.budget_ms, args.max_error_rate)
        at_common = _at_rate(points, common) if common else None
        rows[record["server"]] = {
            "client": record.get("client"),
            "max_rate_under_budget_rps": best.load if best else None,
            "achieved_rps_at_that_rate": best.throughput_rps if best else None,
            "p99_ms_at_that_rate": best.p99_ms if best else None,
            "peak_throughput_rps": max(p.throughput_rps for p in points),
            "p99_ms_at_common_rate": at_common.p99_ms if at_common else math.nan,
            "server_cpu_ms_per_req_at_common_rate": _cpu_ms_per_ok(at_common),
        }
    print_points(records)
    print()
    print(
        f"budget: p99 <= {args.budget_ms:g} ms, errors <= {args.max_error_rate:.2%}; "
        f"common rate {_fmt(common, ' req/s') if common else 'n/a'}"
    )
    header = (
        f"{'server':<19} {'client':<13} {'max rate in budget':>19} {'p99 there':>10} "
        f"{'peak got':>10} {'p99 @ common':>13} {'srv CPU-ms/req @ common':>24}"
    )
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        print(
            f"{name:<19} {row['client'] or '':<13} "
            f"{_fmt(row['max_rate_under_budget_rps'], ' req/s'):>19} "
            f"{_fmt(row['p99_ms_at_that_rate'], ' ms'):>10} "
            f"{_fmt(row['peak_throughput_rps'], ' req/s'):>10} "
            f"{_fmt(row['p99_ms_at_common_rate'], ' ms'):>13} "
            f"{_fmt3(row['server_cpu_ms_per_req_at_common_rate']):>24}"
        )
    ratios = {}
    # riskserve against each peer, batching on against off (riskserve / riskserve-nobatch), and
    # the do-nothing gRPC server against riskserve and the peers.
    pairs = [(ours, peer) for ours in ("riskserve", "riskserve-nobatch", *FLOORS) for peer in PEERS]
    for ours, peer in [*pairs, ("riskserve", "riskserve-nobatch"), ("riskserve", FLOOR)]:
        if ours not in rows or peer not in rows:
            continue
        a, b = rows[ours], rows[peer]
        rate_ratio = (
            a["max_rate_under_budget_rps"] / b["max_rate_under_budget_rps"]
            if a["max_rate_under_budget_rps"] and b["max_rate_under_budget_rps"]
            else None
        )
        p99_a, p99_b = a["p99_ms_at_common_rate"], b["p99_ms_at_common_rate"]
        p99_ratio = (
            p99_a / p99_b
            if p99_a and p99_b and math.isfinite(p99_a) and math.isfinite(p99_b)
            else None
        )
        ratios[f"{ours}/{peer}"] = {
            "max_rate_under_budget": rate_ratio,
            "p99_at_common_rate": p99_ratio,
        }
    if ratios:
        print()
        print("ratios (max rate: higher is better; p99: lower is better)")
        for key, value in ratios.items():
            rate = (
                f"{value['max_rate_under_budget']:.2f}x"
                if value["max_rate_under_budget"]
                else "n/a"
            )
            p99 = f"{value['p99_at_common_rate']:.2f}x" if value["p99_at_common_rate"] else "n/a"
            print(f"  {key:<28} max rate {rate:>7}   p99 at common rate {p99:>7}")
    else:
        print("\nno ratios: this run lacks riskserve, or every server to compare it with")
    return {"common_rate_rps": common, "servers": rows, "ratios": ratios}


def plot(records: Sequence[dict], args: argparse.Namespace, path: Path) -> Path | None:
    """p99 (solid) and p50 (dotted) against achieved throughput, open-loop points, log scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed in this environment: no plot drawn")
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for record in records:
        points = sorted(
            (p for p in _points(record) if p.mode == "rate" and math.isfinite(p.p99_ms)),
            key=lambda p: p.load,
        )
        if not points:
            continue
        x = [p.throughput_rps for p in points]
        (line,) = ax.plot(
            x, [p.p99_ms for p in points], marker="o", label=f"{record['server']} p99"
        )
        ax.plot(
            x,
            [p.p50_ms for p in points],
            linestyle=":",
            color=line.get_color(),
            label=f"{record['server']} p50",
        )
    ax.axhline(args.budget_ms, color="grey", linestyle="--", linewidth=1, label="p99 budget")
    ax.set_yscale("log")
    ax.set_xlabel("achieved throughput (req/s), open-loop Poisson load")
    ax.set_ylabel("latency (ms)")
    ax.set_title(
        f"OIP ModelInfer, batch 1, history {args.history_len} rows, {os.cpu_count()} cores"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default=",".join(ALL_SERVERS), help="comma-separated")
    parser.add_argument("--client", choices=("loadgen", "perf_analyzer"), default="loadgen")
    parser.add_argument("--model", type=Path, default=None, help="ONNX file (default: demo model)")
    parser.add_argument("--rates", type=floats, default=[250, 500, 1000, 1500, 2000, 3000])
    parser.add_argument("--concurrency", type=_ints, default=[1, 8])
    parser.add_argument("--duration-s", type=float, default=5.0, help="per load point")
    parser.add_argument("--max-requests", type=int, default=50_000, help="per load point")
    parser.add_argument("--history-len", type=int, default=32)
    parser.add_argument("--client-procs", type=int, default=1, help="loadgen processes")
    parser.add_argument("--timeout-s", type=float, default=1.0, help="per-request deadline")
    parser.add_argument("--budget-ms", type=float, default=10.0)
    parser.add_argument("--max-error-rate", type=float, default=0.001)
    parser.add_argument(
        "--stop-after-failures",
        type=int,
        default=2,
        help="end a rate sweep after this many points over budget (0: never)",
    )
    parser.add_argument(
        "--common-rate",
        type=float,
        default=None,
        help="rate for the p99 ratio (default: highest rate all servers answered)",
    )
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_KNOBS.max_batch_size)
    parser.add_argument(
        "--triton-queue-delay-us", type=int, default=DEFAULT_KNOBS.triton_queue_delay_us
    )
    parser.add_argument(
        "--mlserver-batch-time-s", type=float, default=DEFAULT_KNOBS.mlserver_batch_time_s
    )
    parser.add_argument("--intra-op-threads", type=int, default=DEFAULT_KNOBS.intra_op_threads)
    parser.add_argument(
        "--riskserve-budget-ms",
        type=float,
        default=None,
        help="RISKSERVE_BUDGET_MS for riskserve: the deadline it applies to requests without a "
        "gRPC deadline (perf_analyzer sends none; loadgen sends --timeout-s)",
    )
    parser.add_argument("--tag", default="", help="added to the result file names")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="re-summarize and re-plot an earlier result file instead of running servers",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        earlier = json.loads(args.from_json.read_text())
        args.history_len = earlier["settings"].get("history_len", args.history_len)
        summarize(earlier["records"], args)
        png = plot(earlier["records"], args, args.from_json.with_suffix(".png"))
        print(f"\nplot: {png}" if png else "")
        return 0
    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    onnx_path = resolve_model_path(args.model)
    knobs = Knobs(
        args.max_batch_size,
        args.triton_queue_delay_us,
        args.mlserver_batch_time_s,
        args.intra_op_threads,
        args.riskserve_budget_ms,
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + (f"-{args.tag}" if args.tag else "")
    model_label = (
        onnx_path.relative_to(REPO_ROOT) if onnx_path.is_relative_to(REPO_ROOT) else onnx_path
    )
    print(
        f"model {model_label}; history {args.history_len} rows; client {args.client}; "
        f"{os.cpu_count()} CPU cores shared by client and server; "
        f"load average now {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    records = []
    for name in names:
        records.append(_run_one(name, args, onnx_path, knobs))
        time.sleep(1.0)
    summary = summarize(records, args)
    # The do-nothing floors answer zeros by design: only servers that run the model are compared.
    scores = {
        r["server"]: r["warmup_score"]
        for r in records
        if "warmup_score" in r and r["server"] not in (FLOOR, FLOOR_SYNC)
    }
    if scores and max(scores.values()) - min(scores.values()) > 1e-3:
        print(f"WARNING: the servers scored the same request differently: {scores}")
    out = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "gpu": shutil.which("nvidia-smi") is not None,
        },
        "model": str(model_label),
        "settings": {k: v for k, v in vars(args).items()},
        "summary": summary,
        "records": records,
    }
    json_path = RESULTS_DIR / f"compare-{stamp}.json"
    json_path.write_text(json.dumps(out, indent=2, default=str))
    png = plot(records, args, RESULTS_DIR / f"compare-{stamp}.png")
    print(
        f"\nwrote {json_path.relative_to(REPO_ROOT)}"
        + (f" and {png.relative_to(REPO_ROOT)}" if png else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
