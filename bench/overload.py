"""Overload, side by side: capacity, then twice and four times it; 64 closed-loop callers.

Each server is pinned to one core (`--server-cpus`, 0) and the load client to another
(`--client-cpus`, the last one). Every call is an OIP ModelInfer of the demo model (batch 1,
pre-serialized) with a gRPC deadline of `--deadline-ms` (10). For each server:

- capacity C: the highest open-loop (Poisson) rate, in steps of `--step-rps` (250), at which at
  least 99 % of the calls are answered OK within the deadline (`--step-s` a step);
- at 2C and 4C offered for `--duration-s` each: OK answers a second (and as a share of C), and
  of the calls not answered, the share refused explicitly (RESOURCE_EXHAUSTED or UNAVAILABLE)
  within 3 ms; right after 4C the rate drops to C/2 for 3 s, and the p99 of the calls sent from
  1 s after the drop says whether the service is back inside the budget;
- 64 closed-loop callers, each sending its next call when the last one ends, whatever its end;
  for riskserve also through the project's client (riskclient, the Score API): on its shared
  streams (its default), then with unary calls (its adaptive throttle on);
- whether the health service said SERVING every time it was asked (every 50 ms) under load.

The servers: riskserve as `make serve` and the image run it (the HAProxy front before one
worker on the same core), riskserve alone (`RISKSERVE_FRONT=none`, the development server),
and Triton 2.51 (Python backend running ONNX Runtime, dynamic batching; `bench/peers/setup.sh`
installs it, and it is skipped with a note where it is not installed).

    .venv/bin/python -m bench.overload
    .venv/bin/python -m bench.overload --servers front --duration-s 5

The client is Python (grpc.aio) on one core, and is never asked for more than `--max-rps`
(6,000) calls a second: where 2C or 4C is more, the cell says what was offered. A cell where the
client sent over a tenth of its calls more than 1 ms late says so (client-bound).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.loadgen import poisson_offsets
from bench.model_io import make_request_arrays, read_model_io, resolve_model_path
from bench.oip import MODEL_INFER_METHOD, build_infer_request
from bench.score_load import score_requests
from bench.servers import ServerProcess, ServerSpec, free_port

REPO = Path(__file__).resolve().parents[1]
RISKSERVE = REPO / ".venv" / "bin" / "riskserve"
RESULTS = REPO / "bench" / "results"
REFUSALS = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})
FAST_REFUSAL_S = 0.003
LATE_S = 0.001  # a call sent this much after it was due shows a client that cannot keep up
OK_SHARE = 0.99
START_MARGIN_S = 0.5
RECOVERY_S = 3.0
NONE = "-"  # a cell with no figure


@dataclass(frozen=True)
class Calls:
    """One run's calls: when each was due (s from the start), how long it took, its status,
    and how late the client sent it (open loop)."""

    due_s: np.ndarray
    took_s: np.ndarray
    codes: np.ndarray
    late_s: np.ndarray

    @classmethod
    def merge(cls, parts: Sequence[Calls]) -> Calls:
        return cls(
            np.concatenate([p.due_s for p in parts]),
            np.concatenate([p.took_s for p in parts]),
            np.concatenate([p.codes for p in parts]),
            np.concatenate([p.late_s for p in parts]),
        )

    def window(self, start_s: float, end_s: float) -> Calls:
        keep = (self.due_s >= start_s) & (self.due_s < end_s)
        return Calls(self.due_s[keep], self.took_s[keep], self.codes[keep], self.late_s[keep])

    def ok(self, deadline_s: float) -> np.ndarray:
        return (self.codes == "OK") & (self.took_s <= deadline_s)

    def fast_refusals(self) -> int:
        refused = np.isin(self.codes, list(REFUSALS)) & (self.took_s <= FAST_REFUSAL_S)
        return int(refused.sum())


def _calls(due: list, took: list, codes: list, late: list | None = None) -> Calls:
    zeros = [0.0] * len(due)
    return Calls(
        np.array(due), np.array(took), np.array(codes, dtype=object), np.array(late or zeros)
    )


def _pin(cpus: set[int]) -> None:
    os.sched_setaffinity(0, cpus)


async def _open_loop(
    target: str, method: str, payload: bytes, offsets: Sequence[float], start: float, d: float
) -> Calls:
    due, took, codes, late = [], [], [], []
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(method)  # bytes in, bytes out
        await channel.channel_ready()
        loop = asyncio.get_running_loop()
        t0 = loop.time() + (start - time.time())
        tasks: set[asyncio.Task[None]] = set()

        async def one(offset: float) -> None:
            scheduled = t0 + offset
            code = "OK"
            lag = loop.time() - scheduled
            try:
                await call(payload, timeout=max(1e-3, d - (loop.time() - scheduled)))
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
            due.append(offset)
            took.append(loop.time() - scheduled)
            codes.append(code)
            late.append(lag)

        for offset in offsets:
            delay = t0 + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(offset))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
    return _calls(due, took, codes, late)


async def _call_loops(
    callers: int, start: float, run_s: float, send: Callable[[int], Awaitable[str]]
) -> Calls:
    """`callers` loops from wall time `start` for `run_s`, each sending its next call (`send`,
    given the loop's index, returns the status name) as soon as the last one ended."""
    due, took, codes = [], [], []
    loop = asyncio.get_running_loop()
    t0 = loop.time() + (start - time.time())
    await asyncio.sleep(max(0.0, t0 - loop.time()))

    async def caller(index: int) -> None:
        while loop.time() < t0 + run_s:
            sent = loop.time()
            code = await send(index)
            due.append(sent - t0)
            took.append(loop.time() - sent)
            codes.append(code)

    await asyncio.gather(*(caller(i) for i in range(callers)))
    return _calls(due, took, codes)


async def _closed_loop(
    target: str, method: str, payload: bytes, callers: int, start: float, run_s: float, d: float
) -> Calls:
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(method)
        await channel.channel_ready()

        async def send(_: int) -> str:
            try:
                await call(payload, timeout=d)
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return "OK"

        return await _call_loops(callers, start, run_s, send)


async def _riskclient_loop(
    target: str,
    payloads: list[bytes],
    callers: int,
    start: float,
    run_s: float,
    d: float,
    shared_stream: bool,
) -> Calls:
    from riskclient import AsyncRiskClient, ScoringError
    from riskscoring.v1 import risk_scoring_pb2 as pb

    requests = [pb.ScoreRequest.FromString(p) for p in payloads]
    async with AsyncRiskClient(target, timeout_s=d, shared_stream=shared_stream) as client:

        async def send(index: int) -> str:
            try:
                await client.score(requests[index % len(requests)])
            except ScoringError as exc:
                # A throttled call ends before any await: let the other callers run, as a
                # decision system's next transaction would come later.
                await asyncio.sleep(0)
                return exc.code.name
            return "OK"

        return await _call_loops(callers, start, run_s, send)


def _run(coroutine_factory: Callable[..., object], *args: object) -> Calls:
    return asyncio.run(coroutine_factory(*args))  # type: ignore[arg-type]


class Client:
    """The load client: one process pinned to the client cores, kept for a server's run."""

    def __init__(self, target: str, cpus: set[int], deadline_s: float, model: str) -> None:
        self.target = target
        self.deadline_s = deadline_s
        io = read_model_io(resolve_model_path(None))
        request = build_infer_request(model, make_request_arrays(io, 32, seed=1), io.output)
        self.payload = request.SerializeToString()
        self.scores = score_requests(64, 32)
        self.pool = ProcessPoolExecutor(
            1, mp_context=get_context("spawn"), initializer=_pin, initargs=(cpus,)
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def open_loop(self, offsets: np.ndarray) -> Calls:
        start = time.time() + START_MARGIN_S
        args = (self.target, MODEL_INFER_METHOD, self.payload, offsets.tolist(), start)
        return self.pool.submit(_run, _open_loop, *args, self.deadline_s).result()

    def closed_loop(
        self, callers: int, run_s: float, riskclient: bool = False, shared_stream: bool = True
    ) -> Calls:
        """`callers` calling back to back: pre-serialized ModelInfer calls, or through
        riskclient (Score on its shared streams, or unary calls)."""
        start = time.time() + START_MARGIN_S
        if riskclient:
            args = (self.target, self.scores, callers, start, run_s, self.deadline_s)
            return self.pool.submit(_run, _riskclient_loop, *args, shared_stream).result()
        args2 = (self.target, MODEL_INFER_METHOD, self.payload, callers, start, run_s)
        return self.pool.submit(_run, _closed_loop, *args2, self.deadline_s).result()


class HealthWatch:
    """Asks the health service every 50 ms on a connection of its own, in a thread."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.seen: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        with grpc.insecure_channel(self.target) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            while not self._stop.wait(0.05):
                try:
                    reply = check(health_pb2.HealthCheckRequest(), timeout=1)
                    self.seen[health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)] += 1
                except grpc.RpcError as exc:
                    self.seen[exc.code().name] += 1


@dataclass
class Row:
    """One server's figures."""

    server: str
    capacity_rps: float = 0.0
    overload: dict[int, str] | None = None
    closed: str = NONE
    riskclient: str = NONE
    riskclient_unary: str = NONE
    recovery: str = NONE
    health: str = NONE
    note: str = ""


def _ok_rate(calls: Calls, deadline_s: float, seconds: float) -> float:
    return calls.ok(deadline_s).sum() / seconds


def find_capacity(client: Client, args: argparse.Namespace, log: Callable[[str], None]) -> float:
    capacity, rate = 0.0, float(args.step_rps)
    while rate <= args.max_rps:
        offsets = poisson_offsets(rate, args.step_s, 10**7, seed=int(rate))
        calls = client.open_loop(offsets)
        share = calls.ok(client.deadline_s).mean() if calls.codes.size else 0.0
        log(f"  {rate:,.0f} req/s offered: {share:.2%} OK within the deadline")
        if share < OK_SHARE:
            break
        capacity, rate = rate, rate + args.step_rps
        time.sleep(args.cooldown_s)
    return capacity


def overload_point(
    client: Client, capacity: float, factor: int, args: argparse.Namespace
) -> tuple[str, str]:
    """`factor` x C for the duration, then C/2 for RECOVERY_S: (the point's cell, recovery)."""
    rate, run_s = min(capacity * factor, args.max_rps), args.duration_s
    busy = poisson_offsets(rate, run_s, 10**7, seed=factor)
    calm = run_s + poisson_offsets(capacity / 2, RECOVERY_S, 10**7, seed=factor + 100)
    calls = client.open_loop(np.concatenate([busy, calm]))
    during = calls.window(0, run_s)
    ok = during.ok(client.deadline_s)
    missed = int((~ok).sum())
    fast = during.fast_refusals()
    refused = f"{fast / missed:.0%}" if missed else NONE
    late = (during.late_s > LATE_S).mean() if during.codes.size else 0.0
    cell = (
        f"{ok.sum() / run_s:,.0f} ({ok.sum() / run_s / capacity:.2f} C; offered "
        f"{during.codes.size / run_s:,.0f}/s; {refused} of the rest refused within 3 ms"
        + (f"; the client sent {late:.0%} over 1 ms late: client-bound" if late > 0.1 else "")
        + ")"
    )
    after = calls.window(run_s + 1.0, run_s + RECOVERY_S)
    answered = after.ok(client.deadline_s)
    if after.codes.size and answered.mean() >= OK_SHARE:
        p99 = np.percentile(after.took_s, 99) * 1e3
        recovery = f"p99 {p99:.1f} ms, {answered.mean():.1%} OK"
    else:
        recovery = f"{answered.mean():.1%} OK" if after.codes.size else NONE
    return cell, recovery


def measure(
    name: str, spec: ServerSpec, args: argparse.Namespace, log: Callable[[str], None]
) -> Row:
    row = Row(name)
    deadline_s = args.deadline_ms / 1e3
    with ServerProcess(spec, RESULTS / f"overload-{spec.name}.log") as server:
        client = Client(server.target, args.client_cpu_set, deadline_s, spec.model_name)
        try:
            client.open_loop(poisson_offsets(200, 1.0, 10**7, seed=0))  # warm both ends
            log(f"{name}: finding capacity")
            row.capacity_rps = find_capacity(client, args, log)
            if not row.capacity_rps:
                row.note = "not one step within the deadline"
                return row
            row.overload = {}
            with HealthWatch(server.target) as health:
                for factor in (2, 4):
                    time.sleep(args.cooldown_s)
                    cell, recovery = overload_point(client, row.capacity_rps, factor, args)
                    row.overload[factor] = cell
                    log(f"  {factor}C: {cell}")
                    if factor == 4:
                        row.recovery = recovery
                        log(f"  after 4C: {recovery}")

                def closed(what: str, **how: bool) -> str:
                    """`args.callers` closed-loop callers after a cooldown: OK/s, as of C."""
                    time.sleep(args.cooldown_s)
                    calls = client.closed_loop(args.callers, args.duration_s, **how)
                    ok = _ok_rate(calls, deadline_s, args.duration_s)
                    cell = f"{ok:,.0f} ({ok / row.capacity_rps:.2f} C)"
                    log(f"  {what}: {cell}")
                    return cell

                row.closed = closed(f"{args.callers} closed-loop callers")
                if spec.name.startswith("riskserve"):
                    row.riskclient = closed("through riskclient", riskclient=True)
                    row.riskclient_unary = closed(
                        "through riskclient, unary calls", riskclient=True, shared_stream=False
                    )
            row.health = "yes" if set(health.seen) == {"SERVING"} else str(dict(health.seen))
        finally:
            client.close()
    return row


def _riskserve(front: str, args: argparse.Namespace) -> ServerSpec:
    port = free_port()
    env = {
        "RISKSERVE_PORT": str(port),
        "RISKSERVE_METRICS_PORT": str(free_port()),
        "RISKSERVE_TRACE_FILE": "none",
        "RISKSERVE_FRONT": front,
        "RISKSERVE_FRONT_METRICS_PORT": "0",
        "RISKSERVE_BUDGET_MS": f"{args.deadline_ms:g}",
    }
    argv = ("taskset", "-c", args.server_cpus, str(RISKSERVE), "serve")
    return ServerSpec(f"riskserve-{front}", argv, port, "fraud-demo", env=env, cwd=REPO)


def _triton(args: argparse.Namespace) -> ServerSpec | str:
    from bench.peers.triton import PEERS_DIR, TRITON_VENV, TritonConfig, triton_spec

    if not (TRITON_VENV / "bin" / "python").exists():
        return "not installed: bench/peers/setup.sh installs it"
    spec = triton_spec(
        resolve_model_path(None), PEERS_DIR / "work" / "triton-overload", TritonConfig(),
        free_port(),
    )  # fmt: skip
    return ServerSpec(
        spec.name, ("taskset", "-c", args.server_cpus, *spec.argv), spec.grpc_port,
        spec.model_name, env=spec.env, cwd=spec.cwd,
    )  # fmt: skip


SERVERS = {
    "front": ("riskserve as deployed (HAProxy, 1 worker)", lambda a: _riskserve("haproxy", a)),
    "lone": ("riskserve alone (RISKSERVE_FRONT=none)", lambda a: _riskserve("none", a)),
    "triton": ("Triton 2.51 (Python backend + ONNX Runtime)", _triton),
}


def table(rows: list[Row], args: argparse.Namespace) -> str:
    lines = [
        "| | " + " | ".join(r.server for r in rows) + " |",
        "|---|" + "---|" * len(rows),
        "| capacity C (req/s, ≥ 99 % OK within the deadline) | "
        + " | ".join(f"{r.capacity_rps:,.0f}" for r in rows) + " |",
    ]  # fmt: skip
    for factor in (2, 4):
        cells = [(r.overload or {}).get(factor, r.note or NONE) for r in rows]
        lines.append(f"| OK/s at {factor}C offered | " + " | ".join(cells) + " |")
    lines += [
        "| p99, 1 to 3 s after 4C ends (C/2 offered) | "
        + " | ".join(r.recovery for r in rows) + " |",
        f"| {args.callers} closed-loop callers, OK/s | "
        + " | ".join(r.closed for r in rows) + " |",
        f"| {args.callers} callers through riskclient (shared streams, its default), OK/s | "
        + " | ".join(r.riskclient for r in rows) + " |",
        f"| {args.callers} callers through riskclient, unary calls, OK/s | "
        + " | ".join(r.riskclient_unary for r in rows) + " |",
        "| health SERVING throughout | " + " | ".join(r.health for r in rows) + " |",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="front,lone,triton", help="of: front, lone, triton")
    parser.add_argument("--deadline-ms", type=float, default=10.0)
    parser.add_argument("--step-rps", type=int, default=250)
    parser.add_argument(
        "--max-rps",
        type=int,
        default=6000,
        help="the most the client is asked to send (one Python core sends about this many)",
    )
    parser.add_argument("--step-s", type=float, default=5.0)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--cooldown-s", type=float, default=1.0)
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--server-cpus", default="0")
    parser.add_argument("--client-cpus", default=str(max(os.sched_getaffinity(0))))
    args = parser.parse_args(argv)
    args.client_cpu_set = {int(c) for c in args.client_cpus.split(",")}
    _pin(args.client_cpu_set)  # the health watch and this process stay off the server's core
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"server on CPU {args.server_cpus}, client on CPU {args.client_cpus}; deadline "
        f"{args.deadline_ms:g} ms; load average {load}",
        flush=True,
    )
    rows = []
    for key in args.servers.split(","):
        name, make = SERVERS[key.strip()]
        spec = make(args)
        if isinstance(spec, str):
            rows.append(Row(name, note=spec))
            print(f"{name}: {spec}", flush=True)
            continue
        try:
            rows.append(measure(name, spec, args, lambda line: print(line, flush=True)))
        except RuntimeError as exc:  # a server that did not start: its row says so
            print(exc, flush=True)
            rows.append(Row(name, note=str(exc)))
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
