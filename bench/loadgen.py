"""Load generator over OIP ModelInfer (gRPC): open-loop Poisson rates and closed-loop concurrency.

Open loop: for an offered rate the send times of a whole point are drawn up front (exponential
gaps), split round-robin over the client processes, and each request is sent at its time
whatever the others are doing. Latency runs from the *scheduled* send time, so a client or
server that falls behind shows up as latency instead of being hidden (coordinated omission).
Closed loop: N callers, each sending its next request when the last one returns.

Each point is bounded by a duration and a request count and stops by itself; every request
has a deadline. The client processes share the machine's cores with the server under test, so
on a small machine the client takes CPU from the server: `bench.perf_analyzer` is the
lower-CPU client, and the client's own send lag is reported in each point's note.

    .venv/bin/python -m bench.loadgen --target 127.0.0.1:8001 --rates 200,500,1000 \
        --concurrency 1,8 --duration-s 5
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import grpc
import numpy as np

from bench.model_io import make_request_arrays, read_model_io, resolve_model_path
from bench.oip import MODEL_INFER_METHOD, build_infer_request, decode_output
from bench.results import (
    PointResult,
    add_sweep_arguments,
    summarize,
    sweep_and_report,
)

__all__ = ["LoadGenerator", "LoadPlan", "main"]

START_MARGIN_S = 0.5  # lets every client process connect before the first scheduled send
# The event loop's timers wake up to ~1 ms late (epoll's resolution): waking this much early
# keeps that timer error out of the latencies, which run from min(scheduled, sent), so that a
# client that is really behind still has its lag charged to the request.
EARLY_WAKE_S = 0.001


@dataclass(frozen=True)
class LoadPlan:
    """What one sweep sends, and the limits that keep each point bounded."""

    target: str
    model_name: str = "fraud-demo"
    history_len: int = 32
    duration_s: float = 5.0
    max_requests: int = 100_000
    timeout_s: float = 1.0
    client_procs: int = 2
    max_in_flight_per_proc: int = 4096
    warmup_requests: int = 200
    cooldown_s: float = 1.0
    seed: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace, target: str, model_name: str) -> LoadPlan:
        """The plan that the options of `bench.loadgen` and `bench.compare` describe."""
        return cls(
            target=target,
            model_name=model_name,
            history_len=args.history_len,
            duration_s=args.duration_s,
            max_requests=args.max_requests,
            timeout_s=args.timeout_s,
            client_procs=args.client_procs,
        )


@dataclass(frozen=True)
class _Share:
    """One client process's part of a point, plus raw outcomes it sends back."""

    latencies_s: list[float]
    error_codes: list[str]
    send_lag_s: list[float]
    last_done_s: float
    cpu_s: float = 0.0


async def _open_loop(
    target: str,
    payload: bytes,
    offsets_s: Sequence[float],
    start_wall: float,
    timeout_s: float,
    max_in_flight: int,
) -> _Share:
    latencies: list[float] = []
    codes: list[str] = []
    lags: list[float] = []
    last_done = 0.0
    async with grpc.aio.insecure_channel(target) as channel:
        # No serializers: the request is sent as pre-built bytes, the reply left undecoded.
        call = channel.unary_unary(MODEL_INFER_METHOD)
        await channel.channel_ready()
        loop = asyncio.get_running_loop()
        t0 = loop.time() + (start_wall - time.time())
        in_flight: set[asyncio.Task] = set()

        async def one(scheduled: float) -> None:
            nonlocal last_done
            # From the schedule, or from the send where the early wake-up sent it first: a
            # late send is charged its lag, an early one not credited with the wait it skipped.
            sent = loop.time()
            origin = min(scheduled, sent)
            try:
                await call(payload, timeout=max(1e-3, timeout_s - max(0.0, sent - scheduled)))
                now = loop.time()
                latencies.append(now - origin)
            except grpc.aio.AioRpcError as exc:
                now = loop.time()
                codes.append(exc.code().name)
            last_done = max(last_done, now - t0)

        for offset in offsets_s:
            scheduled = t0 + offset
            delay = scheduled - loop.time() - EARLY_WAKE_S
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(max(0.0, loop.time() - scheduled))
            if len(in_flight) >= max_in_flight:
                codes.append("CLIENT_IN_FLIGHT_LIMIT")
                continue
            task = asyncio.create_task(one(scheduled))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.wait(in_flight)
    return _Share(latencies, codes, lags, last_done)


async def _closed_loop(
    target: str,
    payload: bytes,
    callers: int,
    start_wall: float,
    duration_s: float,
    max_requests: int,
    timeout_s: float,
) -> _Share:
    latencies: list[float] = []
    codes: list[str] = []
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(MODEL_INFER_METHOD)
        await channel.channel_ready()
        loop = asyncio.get_running_loop()
        t0 = loop.time() + (start_wall - time.time())
        await asyncio.sleep(max(0.0, t0 - loop.time()))
        end = t0 + duration_s
        budget = [max_requests]

        async def caller() -> None:
            while loop.time() < end and budget[0] > 0:
                budget[0] -= 1
                started = loop.time()
                try:
                    await call(payload, timeout=timeout_s)
                    latencies.append(loop.time() - started)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code().name)

        await asyncio.gather(*(caller() for _ in range(callers)))
        last_done = loop.time() - t0
    return _Share(latencies, codes, [], last_done)


def _run_open_share(*args) -> _Share:
    started = time.process_time()
    share = asyncio.run(_open_loop(*args))
    return replace(share, cpu_s=time.process_time() - started)


def _run_closed_share(*args) -> _Share:
    started = time.process_time()
    share = asyncio.run(_closed_loop(*args))
    return replace(share, cpu_s=time.process_time() - started)


def poisson_offsets(rate_rps: float, duration_s: float, max_requests: int, seed: int) -> np.ndarray:
    """Send times (s from start) of a Poisson process at `rate_rps`, cut at duration and count."""
    rng = np.random.default_rng(seed)
    expected = int(rate_rps * duration_s * 1.2) + 16
    offsets = np.cumsum(rng.exponential(1.0 / rate_rps, size=min(expected, max_requests)))
    return offsets[offsets < duration_s]


def _lag_note(lags: list[float]) -> str:
    if not lags:
        return ""
    p50, p99 = np.percentile(np.asarray(lags), [50, 99]) * 1e3
    return f"client send lag p50 {p50:.2f} ms, p99 {p99:.2f} ms"


class LoadGenerator:
    """Runs points against one server with a pool of client processes kept for the sweep."""

    def __init__(
        self, plan: LoadPlan, onnx_path: Path | None = None, server_label: str = ""
    ) -> None:
        self.plan = plan
        self.server_label = server_label or plan.target
        io = read_model_io(resolve_model_path(onnx_path))
        arrays = make_request_arrays(io, plan.history_len, seed=plan.seed)
        self.request = build_infer_request(plan.model_name, arrays, io.output)
        self.payload = self.request.SerializeToString()
        self._pool = ProcessPoolExecutor(plan.client_procs, mp_context=get_context("spawn"))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def warm_up(self) -> np.ndarray:
        """Sends warm-up requests one by one; returns the first score to show the server works."""
        from inference import grpc_service_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.plan.target) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            first = decode_output(stub.ModelInfer(self.request, timeout=10.0))
            if first.shape != (1, 1) or not np.isfinite(first).all():
                raise RuntimeError(f"unexpected score {first!r} from {self.plan.target}")
            for _ in range(self.plan.warmup_requests):
                stub.ModelInfer(self.request, timeout=10.0)
        # Also warm the client processes' imports and connections.
        self.run_concurrency(1, duration_s=0.5)
        return first

    def run_rate(self, rate_rps: float, duration_s: float | None = None) -> PointResult:
        plan = self.plan
        duration = duration_s or plan.duration_s
        offsets = poisson_offsets(rate_rps, duration, plan.max_requests, plan.seed + int(rate_rps))
        start_wall = time.time() + START_MARGIN_S
        futures = [
            self._pool.submit(
                _run_open_share,
                plan.target,
                self.payload,
                offsets[i :: plan.client_procs].tolist(),
                start_wall,
                plan.timeout_s,
                plan.max_in_flight_per_proc,
            )
            for i in range(plan.client_procs)
        ]
        shares = [f.result() for f in futures]
        return self._summarize("rate", rate_rps, shares, sent=len(offsets), planned_s=duration)

    def run_concurrency(self, concurrency: int, duration_s: float | None = None) -> PointResult:
        plan = self.plan
        duration = duration_s or plan.duration_s
        procs = min(plan.client_procs, concurrency)
        start_wall = time.time() + START_MARGIN_S
        futures = []
        for i in range(procs):
            callers = concurrency // procs + (1 if i < concurrency % procs else 0)
            futures.append(
                self._pool.submit(
                    _run_closed_share,
                    plan.target,
                    self.payload,
                    callers,
                    start_wall,
                    duration,
                    plan.max_requests // procs,
                    plan.timeout_s,
                )
            )
        shares = [f.result() for f in futures]
        sent = sum(len(s.latencies_s) + len(s.error_codes) for s in shares)
        return self._summarize("concurrency", concurrency, shares, sent=sent, planned_s=duration)

    def _summarize(
        self, mode: str, load: float, shares: list[_Share], sent: int, planned_s: float
    ) -> PointResult:
        window = (
            max([planned_s] + [s.last_done_s for s in shares])
            if mode == "rate"
            else max(s.last_done_s for s in shares)
        )
        return summarize(
            server=self.server_label,
            client=f"loadgen x{self.plan.client_procs}",
            mode=mode,
            load=load,
            latencies_s=[x for s in shares for x in s.latencies_s],
            error_codes=[c for s in shares for c in s.error_codes],
            sent=sent,
            window_s=window,
            note=_lag_note([x for s in shares for x in s.send_lag_s]),
            client_cpu_s=sum(s.cpu_s for s in shares),
        )

    def sweep(
        self,
        rates: Sequence[float] = (),
        concurrencies: Sequence[int] = (),
        budget_ms: float = 10.0,
        max_error_rate: float = 0.001,
        stop_after_failures: int = 2,
        log=print,
        server_cpu: Callable[[], float] | None = None,
    ) -> list[PointResult]:
        """Rates ascending (stopping after `stop_after_failures` misses), then concurrencies.

        `server_cpu`, when given, reads the server's CPU seconds so far; each point then
        records how much CPU the server spent on it.
        """
        return run_sweep(
            lambda mode, load: (
                self.run_rate(load) if mode == "rate" else self.run_concurrency(int(load))
            ),
            rates,
            concurrencies,
            budget_ms,
            max_error_rate,
            stop_after_failures,
            log,
            server_cpu,
            self.plan.cooldown_s,
        )


def run_sweep(
    run_point: Callable[[str, float], PointResult],
    rates: Sequence[float],
    concurrencies: Sequence[int],
    budget_ms: float,
    max_error_rate: float,
    stop_after_failures: int,
    log: Callable[[str], None],
    server_cpu: Callable[[], float] | None,
    cooldown_s: float,
) -> list[PointResult]:
    """Rates ascending, stopping after `stop_after_failures` misses; then concurrencies."""

    def measured(mode: str, load: float) -> PointResult:
        before = server_cpu() if server_cpu else math.nan
        point = run_point(mode, load)
        if server_cpu:
            point = replace(point, server_cpu_s=server_cpu() - before)
        log(format_point(point))
        time.sleep(cooldown_s)
        return point

    points: list[PointResult] = []
    misses = 0
    for rate in sorted(rates):
        point = measured("rate", rate)
        points.append(point)
        passed = point.p99_ms <= budget_ms and point.error_rate <= max_error_rate
        misses = 0 if passed else misses + 1
        if stop_after_failures and misses >= stop_after_failures:
            log(f"  stopping the rate sweep after {misses} points over budget")
            break
    for concurrency in concurrencies:
        points.append(measured("concurrency", concurrency))
    return points


def _ms(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return "inf" if math.isinf(value) else f"{value:.2f}"


def format_point(p: PointResult) -> str:
    load = f"{p.load:g} req/s" if p.mode == "rate" else f"c={p.load:g}"
    errors = f" errors {p.errors} {p.error_codes}" if p.errors else ""
    cpu = ""
    if p.ok and math.isfinite(p.server_cpu_s):
        cpu += f"  server {p.server_cpu_s * 1e3 / p.ok:.2f} CPU-ms/req"
    if p.ok and math.isfinite(p.client_cpu_s):
        cpu += f"  client {p.client_cpu_s * 1e3 / p.ok:.2f} CPU-ms/req"
    return (
        f"  {p.server:<22} {load:>14}  got {p.throughput_rps:8.1f} req/s  p50 {_ms(p.p50_ms):>7}"
        f"  p90 {_ms(p.p90_ms):>7}  p99 {_ms(p.p99_ms):>7}  p99.9 {_ms(p.p999_ms):>7} ms"
        f"{cpu}{errors}{'  (' + p.note + ')' if p.note else ''}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_arguments(parser)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    plan = LoadPlan.from_args(args, args.target, args.model_name)
    with LoadGenerator(plan, args.model) as generator:
        generator.warm_up()
        return sweep_and_report(generator, args)


if __name__ == "__main__":
    sys.exit(main())
