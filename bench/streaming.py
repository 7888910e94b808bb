"""Streams against unary calls, one machine, one run: riskserve, the do-nothing floor, Triton.

Part 1, perf_analyzer (batch-1 requests on the demo model): for each server, unary ModelInfer
and then ModelStreamInfer (``--streaming``), a closed-loop concurrency sweep. Each point gives
perf_analyzer's req/s and client p99, and the server's CPU per request: its CPU time (every
process of its group, from /proc) over the steady part of the run (from `--ramp-s` after
perf_analyzer starts to its exit) divided by the requests answered meanwhile, and that of the
server's own process split by thread: its main thread (a Python server's event loop),
riskserve's engine threads, and the others (gRPC's poller and event-engine threads; Triton's
every thread but its main one, its Python backend's processes not counted). The table shows
concurrency 16 and the best rate whose p99 is within `--p99-ms`.

Part 2, the project's client: `--callers` asyncio tasks scoring back to back, first as unary
Score calls on one channel, then on the ScoreStreams the client shares among concurrent calls
(its default).

Servers: ``riskserve-front`` (as deployed: HAProxy before one worker, calls and streams on its
call lane), ``riskserve`` (the lone server; both batching on, budget `--budget-ms`, FP32 ONNX
Runtime as the peers),
``grpc-floor`` (bench.rpc_floor: answers zeros, computes nothing) and ``triton`` (tritonserver
2.51 with the Python backend running ONNX Runtime, dynamic batching; bench/peers/setup.sh).
Clients share the cores with the server; compare only figures of one run.

    .venv/bin/python -m bench.streaming
    .venv/bin/python -m bench.streaming --servers riskserve --concurrency 16 --callers 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.compare import FLOOR, RESULTS_DIR, Knobs, Skip, riskserve_knobs, server_spec
from bench.model_io import DEMO_MODEL_PATH, make_request_arrays, read_model_io
from bench.perf_analyzer import PerfAnalyzer, PerfPlan
from bench.results import PointResult
from bench.servers import ServerProcess

__all__ = [
    "Point",
    "add_sweep_arguments",
    "best_point",
    "main",
    "perf_points",
    "point_row",
    "started_servers",
]

SERVERS = ("riskserve-front", "riskserve", FLOOR, "triton")
MODES = ("unary", "streaming")
MANIFEST = DEMO_MODEL_PATH.parent / "manifest.json"


@dataclass(frozen=True)
class Point:
    """One load point and the server CPU it cost."""

    server: str
    mode: str
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_request: float
    errors: int
    note: str = ""
    # Both the server's CPU and the client's, and the kernel's: the whole machine's busy time.
    machine_cpu_us_per_request: float = math.nan
    # The server process's CPU by thread (`THREAD_KINDS`), µs a request; empty where unknown.
    threads_us: dict[str, float] = field(default_factory=dict)


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy, all cores (neither idle nor waiting on IO)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


# The threads of a server process, by what runs there: its main thread (a Python server's
# event loop), riskserve's engine threads (named `engine-<model>-<version>-<i>`, cut to the 15
# bytes the OS keeps) and the rest (gRPC's poller and event-engine threads, Triton's own).
THREAD_KINDS = ("main", "engine", "other")


def _thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds the process `pid`'s live threads have used so far, by `THREAD_KINDS` (Linux;
    empty elsewhere or once the process is gone)."""
    try:
        threads = psutil.Process(pid).threads()
    except (psutil.Error, AttributeError):
        return {}
    seconds = dict.fromkeys(THREAD_KINDS, 0.0)
    for thread in threads:
        kind = "main"
        if thread.id != pid:
            try:
                name = Path(f"/proc/{pid}/task/{thread.id}/comm").read_text().strip()
            except OSError:
                continue  # ended while we looked
            kind = "engine" if name.startswith("engine-") else "other"
        seconds[kind] += thread.user_time + thread.system_time
    return seconds


@dataclass
class _Usage:
    """A server's CPU over a span: per second of it, in all, by thread and on the machine."""

    server_per_s: float = math.nan
    machine_per_s: float = math.nan
    threads_per_s: dict[str, float] = field(default_factory=dict)

    def threads_us(self, rps: float) -> dict[str, float]:
        """The CPU by thread, µs a request at `rps` requests a second."""
        return {kind: _per_request_us(per_s, rps) for kind, per_s in self.threads_per_s.items()}


def _serving_pid(server: ServerProcess) -> int:
    """The process whose threads answer the calls: the server's own, or the one worker behind
    the front (whose HAProxy and supervising process count in the total only)."""
    try:
        children = psutil.Process(server.pid).children(recursive=True)
        names = [c.name() for c in children]
    except psutil.Error:
        return server.pid
    if not any("haproxy" in name for name in names):
        return server.pid  # alone, or a peer (Triton's backend processes are children too)
    workers = [c for c, name in zip(children, names, strict=True) if "haproxy" not in name]
    return workers[0].pid if len(workers) == 1 else server.pid


def _cpu_during(server: ServerProcess, ramp_s: float, run) -> tuple[object, _Usage]:
    """Run `run()`; the server's CPU from `ramp_s` after it starts to its end, and the whole
    machine's busy time over the same span, each per second of the span."""
    marks: dict[str, Any] = {}
    pid = _serving_pid(server)

    def mark() -> None:
        marks["t0"], marks["c0"] = time.monotonic(), server.cpu_seconds()
        marks["m0"], marks["threads"] = _machine_busy_s(), _thread_seconds(pid)

    timer = threading.Timer(ramp_s, mark)
    timer.start()
    try:
        result = run()
    finally:
        timer.cancel()
    end_t, end_cpu, end_busy = time.monotonic(), server.cpu_seconds(), _machine_busy_s()
    end_threads = _thread_seconds(pid)
    if "t0" not in marks or end_t - marks["t0"] < 0.5:
        return result, _Usage()
    span = end_t - marks["t0"]
    threads = {
        kind: (end_threads[kind] - marks["threads"][kind]) / span
        for kind in THREAD_KINDS
        if kind in end_threads and kind in marks["threads"]
    }
    return result, _Usage((end_cpu - marks["c0"]) / span, (end_busy - marks["m0"]) / span, threads)


def perf_points(
    server: ServerProcess,
    name: str,
    args: argparse.Namespace,
    log=print,
    modes: Sequence[str] = MODES,
) -> list[Point]:
    """perf_analyzer's concurrency sweep (`args.concurrency`) in each of `modes`."""
    points: list[Point] = []
    for mode in modes:
        plan = PerfPlan(
            target=server.target,
            history_len=args.history_len,
            window_s=args.window_s,
            windows=args.windows,
            max_threads=max(16, max(args.concurrency)),
            streaming=mode == "streaming",
            timeout_s=args.point_timeout_s,
        )
        with PerfAnalyzer(plan, server_label=name) as analyzer:
            for concurrency in args.concurrency:
                result, usage = _cpu_during(
                    server, args.ramp_s, lambda c=concurrency: analyzer.run_point("concurrency", c)
                )
                assert isinstance(result, PointResult)
                point = _point(name, mode, concurrency, result, usage)
                log(point_row(point))
                points.append(point)
                time.sleep(args.cooldown_s)
                if point.errors:
                    break  # perf_analyzer stops at the first failed request: a higher load too
    return points


def _point(
    name: str,
    mode: str,
    concurrency: int,
    result: PointResult,
    usage: _Usage,
) -> Point:
    rps = result.throughput_rps
    return Point(
        name,
        mode,
        concurrency,
        rps,
        result.p50_ms,
        result.p99_ms,
        _per_request_us(usage.server_per_s, rps),
        result.errors,
        result.note if result.errors else "",
        _per_request_us(usage.machine_per_s, rps),
        usage.threads_us(rps),
    )


def _per_request_us(per_s: float, rps: float) -> float:
    return per_s / rps * 1e6 if rps > 0 else math.nan


# Part 2: the project's client.


def _score_requests(n: int, history_len: int) -> list:
    from riskclient import ScoreRequest

    manifest = json.loads(MANIFEST.read_text())
    io = read_model_io(DEMO_MODEL_PATH)
    requests = []
    for i in range(n):
        arrays = make_request_arrays(io, history_len, seed=i)
        features = arrays[io.features_input][0]
        request = ScoreRequest(
            entity_id=f"e{i}",
            features={
                name: float(v) for name, v in zip(manifest["features"], features, strict=True)
            },
        )
        mask = arrays[io.mask_input][0] > 0
        for row in arrays[io.history_input][0][mask]:
            request.history.add(values=row.tolist())
        requests.append(request)
    return requests


async def _callers(target: str, mode: str, callers: int, duration_s: float, requests) -> dict:
    from riskclient import AsyncRiskClient, ScoringError

    latencies: list[float] = []
    errors = 0
    # The client's default shares a few streams among concurrent callers; unary is the option.
    async with AsyncRiskClient(target, timeout_s=5.0, shared_stream=mode == "stream") as client:
        score = client.score
        for request in requests[:callers]:  # warm the channel (and the stream)
            await score(request)
        stop_at = time.perf_counter() + duration_s

        async def caller(k: int) -> None:
            nonlocal errors
            i = k
            while time.perf_counter() < stop_at:
                message = requests[i % len(requests)]
                started = time.perf_counter()
                try:
                    await score(message)
                    latencies.append(time.perf_counter() - started)
                except ScoringError:
                    errors += 1
                i += callers

        started = time.perf_counter()
        await asyncio.gather(*(caller(k) for k in range(callers)))
        elapsed = time.perf_counter() - started
    ms = np.array(latencies) * 1e3
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(ms, 50)) if len(ms) else math.nan,
        "p99_ms": float(np.percentile(ms, 99)) if len(ms) else math.nan,
        "errors": errors,
    }


def client_points(
    server: ServerProcess, args: argparse.Namespace, log=print, name: str = "riskserve"
) -> list[Point]:
    requests = _score_requests(256, args.history_len)
    points = []
    for mode in ("unary", "stream"):
        result, usage = _cpu_during(
            server,
            args.ramp_s,
            lambda m=mode: asyncio.run(
                _callers(server.target, m, args.callers, args.client_duration_s, requests)
            ),
        )
        assert isinstance(result, dict)
        rps = result["rps"]
        point = Point(
            name,
            f"riskclient {mode}",
            args.callers,
            rps,
            result["p50_ms"],
            result["p99_ms"],
            _per_request_us(usage.server_per_s, rps),
            result["errors"],
            machine_cpu_us_per_request=_per_request_us(usage.machine_per_s, rps),
            threads_us=usage.threads_us(rps),
        )
        log(point_row(point))
        points.append(point)
        time.sleep(args.cooldown_s)
    return points


# The report.


def point_row(p: Point) -> str:
    errors = f"  errors {p.errors}" if p.errors else ""
    note = f"  ({p.note})" if p.note else ""
    return (
        f"  {p.server:<10} {p.mode:<17} c={p.concurrency:<3} {p.rps:8.0f} req/s"
        f"  p50 {p.p50_ms:6.2f}  p99 {p.p99_ms:6.2f} ms  server {p.cpu_us_per_request:5.0f} "
        f"CPU-us/req{_threads_text(p)}  machine {p.machine_cpu_us_per_request:5.0f}{errors}{note}"
    )


def _threads_text(p: Point) -> str:
    """' (main 101, engine 74, other 44)': the server process's CPU a request by thread."""
    if not p.threads_us:
        return ""
    return " (" + ", ".join(f"{k} {v:.0f}" for k, v in p.threads_us.items()) + ")"


def best_point(points: Sequence[Point], p99_ms: float) -> Point | None:
    passing = [p for p in points if not p.errors and p.p99_ms <= p99_ms]
    return max(passing, key=lambda p: p.rps, default=None)


def summarize(points: Sequence[Point], args: argparse.Namespace) -> dict:
    rows: dict[str, dict] = {}
    for server in dict.fromkeys(p.server for p in points):
        for mode in MODES:
            mine = [p for p in points if p.server == server and p.mode == mode]
            if not mine:
                continue
            at16 = next((p for p in mine if p.concurrency == args.at), None)
            best = best_point(mine, args.p99_ms)
            rows[f"{server} {mode}"] = {"at": at16, "best": best}
    print()
    print(
        f"perf_analyzer, batch 1, history {args.history_len}: at c={args.at}, and the best rate"
        f" with p99 <= {args.p99_ms:g} ms over c in {args.concurrency}"
    )
    c, limit = args.at, f"{args.p99_ms:g}"
    print(
        f"| server / mode | req/s at c={c} | p99 ms at c={c} | server CPU µs / request at c={c} "
        f"| of it main / engine / other threads | whole machine CPU µs / request at c={c} "
        f"| best req/s with p99 ≤ {limit} ms (at c) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, row in rows.items():
        at, best = row["at"], row["best"]
        left = "- | - | - | - | -"
        if at:
            threads = " / ".join(f"{at.threads_us.get(k, math.nan):,.0f}" for k in THREAD_KINDS)
            left = (
                f"{at.rps:,.0f} | {at.p99_ms:.2f} | {at.cpu_us_per_request:,.0f} | "
                f"{threads if at.threads_us else '-'} | {at.machine_cpu_us_per_request:,.0f}"
            )
        right = f"{best.rps:,.0f} ({best.concurrency})" if best else "none"
        print(f"| {key} | {left} | {right} |")
    client = [p for p in points if p.mode.startswith("riskclient")]
    if client:
        print()
        print(f"the project's client, {args.callers} concurrent callers, one process")
        for p in client:
            print(
                f"{p.server:<16} {p.mode:<18} {p.rps:>8.0f} req/s  p50 {p.p50_ms:6.2f}  "
                f"p99 {p.p99_ms:6.2f} ms"
                f"  server {p.cpu_us_per_request:5.0f} CPU-us/req"
                + (f"  errors {p.errors}" if p.errors else "")
            )
    targets = _targets(rows, client)
    if targets:
        print()
        for line in targets:
            print(line)
    return {k: {n: (v.__dict__ if v else None) for n, v in r.items()} for k, r in rows.items()}


def _targets(rows: dict[str, dict], client: Sequence[Point]) -> list[str]:
    """The issue's targets, each as a ratio of this run's figures."""
    lines = []

    def get(key: str, part: str) -> Point | None:
        return rows.get(key, {}).get(part)

    triton_stream = get("triton streaming", "at")
    triton_unary = get("triton unary", "best")
    for ours in ("riskserve-front", "riskserve"):
        stream, unary = get(f"{ours} streaming", "at"), get(f"{ours} unary", "at")
        if stream and unary:
            ratio = stream.cpu_us_per_request / unary.cpu_us_per_request
            lines.append(f"{ours} streaming CPU/req / unary: {ratio:.2f} (target <= 0.5)")
        if stream and triton_stream:
            ratio = stream.cpu_us_per_request / triton_stream.cpu_us_per_request
            lines.append(f"{ours} streaming CPU/req / Triton streaming: {ratio:.2f} (target <= 1)")
        best_stream = get(f"{ours} streaming", "best")
        if best_stream and triton_unary:
            ratio = best_stream.rps / triton_unary.rps
            lines.append(
                f"{ours} best streaming rate / Triton's best unary: {ratio:.2f} (target >= 1)"
            )
    for ours in dict.fromkeys(p.server for p in client):
        pair = [p for p in client if p.server == ours]
        if len(pair) == 2:
            unary_c, stream_c = pair
            lines.append(
                f"{ours}: client stream / unary: rate {stream_c.rps / unary_c.rps:.2f}x, "
                f"p99 {stream_c.p99_ms / unary_c.p99_ms:.2f}x (target: rate > 1, p99 < 1)"
            )
    return lines


def add_sweep_arguments(
    parser: argparse.ArgumentParser, servers: Sequence[str], concurrency: Sequence[int]
) -> None:
    """The options of a perf_analyzer sweep over servers (`perf_points`), with their defaults."""
    parser.add_argument("--servers", default=",".join(servers), help="comma-separated")
    parser.add_argument(
        "--concurrency",
        type=lambda t: [int(x) for x in t.split(",")],
        default=list(concurrency),
        help="perf_analyzer's sweep",
    )
    parser.add_argument("--at", type=int, default=16, help="the concurrency the summary compares")
    parser.add_argument("--p99-ms", type=float, default=10.0)
    parser.add_argument("--history-len", type=int, default=32)
    parser.add_argument("--window-s", type=float, default=1.5)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--ramp-s", type=float, default=1.0, help="CPU counts from here")
    parser.add_argument("--cooldown-s", type=float, default=0.5)
    parser.add_argument("--budget-ms", type=float, default=1000.0, help="riskserve's budget")
    parser.add_argument(
        "--point-timeout-s", type=float, default=60.0, help="a perf_analyzer run's time limit"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_arguments(parser, SERVERS, (1, 4, 8, 16, 32, 64))
    parser.add_argument("--callers", type=int, default=64, help="riskclient's callers")
    parser.add_argument("--client-duration-s", type=float, default=5.0)
    parser.add_argument("--no-client", action="store_true", help="skip part 2")
    args = parser.parse_args(argv)
    if args.at not in args.concurrency:
        args.concurrency = sorted({*args.concurrency, args.at})
    return args


def started_servers(
    args: argparse.Namespace, log_prefix: str
) -> Iterator[tuple[str, ServerProcess]]:
    """Each of `args.servers` in turn, started (riskserve with `args.budget_ms`) and stopped
    once the caller is done with it; one that cannot run here is skipped with its reason."""
    knobs: Knobs = riskserve_knobs(args.budget_ms)
    for name in args.servers.split(","):
        try:
            spec = server_spec(name, DEMO_MODEL_PATH, knobs)
        except (Skip, FileNotFoundError) as exc:
            print(f"[{name}] skipped: {exc}")
            continue
        print(f"[{name}]")
        with ServerProcess(spec, RESULTS_DIR / "logs" / f"{log_prefix}_{name}.log") as server:
            yield name, server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    points: list[Point] = []
    for name, server in started_servers(args, "streaming"):
        points += perf_points(server, name, args)
        if name.startswith("riskserve") and not args.no_client:
            points += client_points(server, args, name=name)
    summary = summarize(points, args)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / "streaming.json"
    out.write_text(json.dumps({"args": vars(args), "summary": summary}, indent=2, default=str))
    print(f"\nwrote {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
