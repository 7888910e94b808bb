"""What tracing costs: the request path's recording alone, and a live server on against off.

1. Recording, in process: the calls one scored request makes on `Tracing` (start, the
   validation stage, the deferred scoring details, its share of a batch of 8, end) with the
   deployed policy (ratio 0.01: almost every fast trace dropped) and with every trace kept and
   exported, against the plain SDK's cost of starting and ending the two spans a request would
   need. Median of interleaved repeats. The first three run hot, in a tight loop; the two
   "caches cold" rows time each batch of requests after 128 MB has been written over, as a
   live server's requests meet caches that other work has filled since the request before.
   The last row is the exporter thread's share when every trace is kept: writing a request's
   spans (4 and an eighth: server, three stages, a share of the batch) to a JSON-lines file.
2. End to end: riskserve with tracing on and off (RISKSERVE_TRACING), both running and driven
   at the same moment, each by its own perf_analyzer, for `--rounds` rounds: at closed-loop
   concurrency `--concurrency` (the most each serves while sharing the cores) and at the
   open-loop rate `--rate-rps` per server (a moderate load in all). Throughput, p50/p99 and
   server CPU per request, medians over the rounds, and the median of the per-round on-off
   differences. `--control` adds a pair of two tracing-off servers: the differences the
   machine makes by itself, to read the on-off differences against.
3. Paired requests (`--paired-s`): one open-loop Poisson schedule at `--rate-rps`, and at each
   of its instants one request to every server (on, off, and with --control off-2), in a fresh
   random order, so each request meets the same moment of the machine as its partners. Every
   latency is kept; the p50/p99 of all of a server's requests over the whole run, their
   differences, and a 95 % interval for each difference from a block bootstrap (blocks of
   `--block-s` seconds, resampled alike for every server, so slow stretches of the machine stay
   shared). The run is split into `--legs` legs, each with fresh server processes started in
   a fresh order, and the bootstrap draws legs before blocks, because two equal servers can
   differ for the whole of their lives. Server CPU per request over the run besides.
4. Servers taking turns (`--turns-s`): the same schedule, legs and bootstrap, but each slot of
   `--slot-s` seconds goes to one server alone, slots in rounds of one a server in a fresh
   random order, a round being a bootstrap block. Part 3 keeps every server busy at once, so on
   a machine with few cores their contention makes the tail; here each server meets the load
   `--rate-rps` with the machine to itself, as a deployed one would, and pairing is by round.

Every server runs as `bench.compare` starts it: kept traces go to no exporter, and the 1 s
budget (`--riskserve-budget-ms`) puts the slow-trace threshold at 500 ms. For parts 3 and 4,
`--export` has the tracing-on server write its kept traces to a JSON-lines file, as the
embedded default does; with `--riskserve-budget-ms 10` as well, the run is as deployed.
`--sample-ratio` and `--export-batch` set its share of fast traces kept and the most spans its
batch span processor exports at once, to measure what exporting more costs.

`--save run.npz` keeps every latency of a part 3 or 4 run, with its legs, blocks, failures and
server CPU, settings and seed; `--pool a.npz b.npz ...` reports saved runs as one (each run's
legs kept apart in the bootstrap, the servers every run had) and runs nothing, so a later run
adds to an earlier one's precision. Runs with other settings, or a seed twice, are refused.

    .venv/bin/python -m bench.tracing_overhead --rounds 8 --rate-rps 150 --control
    .venv/bin/python -m bench.tracing_overhead --rounds 0 --paired-s 840 --legs 6 --control
    .venv/bin/python -m bench.tracing_overhead --rounds 0 --turns-s 2700 --legs 18 --control
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind

from bench.compare import RESULTS_DIR, riskserve_knobs, server_spec
from bench.loadgen import EARLY_WAKE_S, START_MARGIN_S, LoadPlan, poisson_offsets
from bench.model_io import make_request_arrays, read_model_io, resolve_model_path
from bench.oip import MODEL_INFER_METHOD, build_infer_request
from bench.perf_analyzer import PerfAnalyzer, PerfPlan
from bench.results import PointResult
from bench.servers import ServerProcess
from service.telemetry import RequestTrace, TailSamplingPolicy, Tracing
from service.telemetry.bootstrap import EXPORT_BATCH_SPANS
from service.telemetry.jsonl_exporter import JsonLinesSpanExporter

BATCH_REQUESTS = 8
EVICT_BYTES = 128 << 20  # written over between batches: several times a server CPU's caches
SERVER_KINDS = {"on": "riskserve", "off": "riskserve-notrace", "off-2": "riskserve-notrace"}


class DiscardingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _tracing(processor: SpanProcessor | None = None, **policy: object) -> Tracing:
    values: dict = {"slow_threshold_ns": 5_000_000, "sample_ratio": 0.01}
    values.update(policy)
    return Tracing(
        TailSamplingPolicy(**values),
        processor or BatchSpanProcessor(DiscardingExporter(), max_queue_size=1 << 16),
        Resource.create({}),
        InstrumentationScope("bench"),
    )


def _record(tracing: Tracing, requests: int) -> float:
    """Seconds per request for the recording the request path does."""
    started = time.perf_counter()
    for _ in range(requests // BATCH_REQUESTS):
        _record_batch(tracing)
    return (time.perf_counter() - started) / requests


def _record_cold(tracing: Tracing, requests: int, evict: np.ndarray) -> float:
    """As `_record`, but each batch's requests are timed after `evict` has been written over
    (untimed), so they find the caches holding other data, as a server's requests do between
    the engine runs, gRPC and event-loop work of the requests before them."""
    spent = 0.0
    for _ in range(requests // BATCH_REQUESTS):
        evict += 1
        started = time.perf_counter()
        _record_batch(tracing)
        spent += time.perf_counter() - started
    return spent / requests


def _record_batch(tracing: Tracing) -> None:
    traces = [
        tracing.start_request("svc/Score", {"rpc.system": "grpc", "rpc.method": "Score"})
        for _ in range(BATCH_REQUESTS)
    ]
    batch = tracing.start_batch(traces, {"riskserve.batch.size": BATCH_REQUESTS})
    batch.end({"riskserve.engine": "onnxruntime-cpu"})
    now = time.monotonic_ns()
    for trace in traces:
        trace.add_stage("riskserve.validate", now, now + 10_000)
        trace.batch = batch
        trace.defer(_scored_details, "fraud-demo", now)
        tracing.end_request(trace, 0)


def _jsonl_writing(requests: int) -> float:
    """Seconds per request for the exporter's thread to write, as JSON lines in the server's
    export batches, the spans of a request whose trace is kept (here every trace is)."""
    kept = InMemorySpanExporter()
    tracing = _tracing(SimpleSpanProcessor(kept), export_all=True)
    for _ in range(requests // BATCH_REQUESTS):
        _record_batch(tracing)
    spans = kept.get_finished_spans()
    with tempfile.TemporaryDirectory() as directory:
        exporter = JsonLinesSpanExporter(Path(directory) / "spans.jsonl")
        started = time.perf_counter()
        for first in range(0, len(spans), EXPORT_BATCH_SPANS):
            exporter.export(spans[first : first + EXPORT_BATCH_SPANS])
        took = time.perf_counter() - started
        exporter.shutdown()
    return took / requests


def _scored_details(trace: RequestTrace, attributes: dict, model: str, now: int) -> None:
    """As the service's: what a kept trace adds on export (attributes, queue and score)."""
    attributes["riskserve.model"] = model
    attributes["riskserve.batch.size"] = BATCH_REQUESTS
    trace.add_stage("riskserve.queue", now, now + 20_000)
    trace.add_stage("riskserve.score", now, now + 30_000, {"riskserve.batch.size": 8})


def _sdk_spans(provider: TracerProvider, requests: int) -> float:
    """Seconds per request to start and end a server span and its share of a batch span."""
    tracer = provider.get_tracer("bench")
    started = time.perf_counter()
    for i in range(requests):
        span = tracer.start_span("svc/Score", kind=SpanKind.SERVER)
        if i % BATCH_REQUESTS == 0:
            tracer.start_span("riskserve.batch").end()
        span.end()
    return (time.perf_counter() - started) / requests


def recording(requests: int, repeats: int) -> dict[str, float]:
    evict = np.zeros(EVICT_BYTES // 8)
    provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(DiscardingExporter(), max_queue_size=1 << 16))
    runs: dict[str, Callable[[], float]] = {
        "riskserve tracing, ratio 0.01 (deployed)": lambda: _record(_tracing(), requests),
        "riskserve tracing, every trace exported": lambda: _record(
            _tracing(export_all=True), requests
        ),
        "SDK spans, 2 per request, all exported": lambda: _sdk_spans(provider, requests),
        "ratio 0.01, caches cold": lambda: _record_cold(_tracing(), requests, evict),
        "every trace exported, caches cold": lambda: _record_cold(
            _tracing(export_all=True), requests, evict
        ),
        "JSON lines, a kept request's spans written": lambda: _jsonl_writing(requests),
    }
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved, so drift in machine load hits them alike
        for name, run in runs.items():
            results[name].append(run())
    provider.shutdown()
    return {name: statistics.median(values) for name, values in results.items()}


def _point(analyzer: PerfAnalyzer, mode: str, load: float, cpu: Callable[[], float]):
    before = cpu()
    point = analyzer.run_point(mode, load)
    cpu_s = cpu() - before
    return point, cpu_s


Runs = dict[str, list[tuple[PointResult, float]]]


def _together(
    runners: dict[str, tuple[PerfAnalyzer, ServerProcess]], mode: str, load: float
) -> dict[str, tuple[PointResult, float]]:
    """Drive every server at once, each with its own perf_analyzer at `load`."""
    with ThreadPoolExecutor(len(runners)) as pool:
        futures = {
            name: pool.submit(_point, analyzer, mode, load, server.cpu_seconds)
            for name, (analyzer, server) in runners.items()
        }
        return {name: future.result() for name, future in futures.items()}


def end_to_end(args: argparse.Namespace) -> Runs:
    """Tracing on and off (and, with --control, a second off) served and driven side by side.

    On a shared machine the noise drifts within seconds, far more than what tracing costs.
    Two servers driven at the same moment see the same machine, so the difference of each
    simultaneous pair is what tracing adds; an off/off control pair shows how large a
    difference the machine alone makes. Pairs take turns round after round.
    """
    onnx_path = resolve_model_path(None)
    pairs = [("on", "off")] + ([("off-2", "off")] if args.control else [])
    results: Runs = {}
    with contextlib.ExitStack() as stack:
        servers = _start_servers(
            stack,
            [name for name in SERVER_KINDS if any(name in pair for pair in pairs)],
            args.riskserve_budget_ms,
        )
        runners: dict[str, tuple[PerfAnalyzer, ServerProcess]] = {}
        for label, server in servers.items():
            plan = PerfPlan(target=server.target, window_s=args.window_s, windows=3)
            analyzer = stack.enter_context(PerfAnalyzer(plan, onnx_path, server_label=label))
            analyzer.run_point("concurrency", 4)  # warm-up
            runners[label] = (analyzer, server)
        for round_ in range(args.rounds):
            for mode, load in (("concurrency", args.concurrency), ("rate", args.rate)):
                for pair in pairs:
                    points = _together({name: runners[name] for name in pair}, mode, load)
                    for name, (point, cpu_s) in points.items():
                        key = f"{name} ({pair[0]}/{pair[1]}) {mode}"
                        results.setdefault(key, []).append((point, cpu_s))
                    print(
                        f"round {round_ + 1} {mode:11} {load:>5g} each, "
                        + "  ".join(
                            f"{name}: {p.throughput_rps:7.1f} req/s p50 {p.p50_ms:6.2f} "
                            f"p99 {p.p99_ms:6.2f} ms CPU {_cpu_ms(p, c):.3f} ms/req"
                            for name, (p, c) in points.items()
                        ),
                        flush=True,
                    )
    return results


def _start_servers(
    stack: contextlib.ExitStack,
    labels: Sequence[str],
    budget_ms: float,
    on_env: dict[str, str] | None = None,
) -> dict[str, ServerProcess]:
    """Servers for `labels`, the tracing-on one with `on_env` added to its environment."""
    onnx_path = resolve_model_path(None)
    knobs = riskserve_knobs(budget_ms)
    servers = {}
    for label in labels:
        spec = server_spec(SERVER_KINDS[label], onnx_path, knobs)
        if label == "on":
            spec = dataclasses.replace(spec, env={**spec.env, **(on_env or {})})
        log_path = RESULTS_DIR / "logs" / f"tracing-overhead-{label}.log"
        servers[label] = stack.enter_context(ServerProcess(spec, log_path))
    return servers


def _tracing_env(args: argparse.Namespace, trace_file: Path | None) -> dict[str, str]:
    """The tracing-on server's settings for parts 3 and 4: with `trace_file` it writes its kept
    traces there, as the embedded default does (otherwise they go to no exporter); with
    --sample-ratio it keeps that share of the fast traces (otherwise 1 %); with --export-batch
    its batch span processor exports at most that many spans at a time (otherwise 64)."""
    env: dict[str, str] = {}
    if trace_file is not None:
        env["RISKSERVE_TRACE_FILE"] = str(trace_file)
    if args.sample_ratio is not None:
        env["RISKSERVE_TRACE_SAMPLE_RATIO"] = f"{args.sample_ratio:g}"
    if args.export_batch is not None:
        env["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] = str(args.export_batch)
    return env


def _cpu_ms(point: PointResult, cpu_s: float) -> float:
    # CPU over the whole perf_analyzer run (3 windows plus its start), per request it sent
    # in the windows: an upper bound, equally so for both servers.
    total = point.throughput_rps * point.duration_s * 3
    return cpu_s / total * 1e3 if total else float("nan")


def _summary(results: Runs, mode: str, load: float, a: str, b: str) -> str:
    """Medians of `a` and `b`, and the median of their per-round differences."""

    # The off server serves in both pairs: take each side's points from this pair's rounds.
    points = {name: results[f"{name} ({a}/{b}) {mode}"] for name in (a, b)}

    def median(name: str, value: Callable[[PointResult, float], float]) -> float:
        return statistics.median(value(p, c) for p, c in points[name])

    def paired(value: Callable[[PointResult, float], float]) -> list[float]:
        rounds = zip(points[a], points[b], strict=True)
        return [value(*x) - value(*y) for x, y in rounds]

    tput_a, tput_b = (
        median(a, lambda p, c: p.throughput_rps),
        median(b, lambda p, c: p.throughput_rps),
    )
    p99_a, p99_b = median(a, lambda p, c: p.p99_ms), median(b, lambda p, c: p.p99_ms)
    cpu_a, cpu_b = median(a, _cpu_ms), median(b, _cpu_ms)
    d_p99 = paired(lambda p, c: p.p99_ms)
    d_p50 = paired(lambda p, c: p.p50_ms)
    d_tput = paired(lambda p, c: math.log(p.throughput_rps))
    d_cpu = paired(lambda p, c: math.log(_cpu_ms(p, c)))
    return (
        f"   {mode} {load:g} each, {a} against {b}: throughput {tput_a:.1f}/{tput_b:.1f} req/s, "
        f"p99 {p99_a:.2f}/{p99_b:.2f} ms, server CPU {cpu_a:.3f}/{cpu_b:.3f} ms/req\n"
        f"      paired by round (median, and range): throughput "
        f"{_pct(statistics.median(d_tput))} ({_pct(min(d_tput))} to {_pct(max(d_tput))}), "
        f"server CPU per request {_pct(statistics.median(d_cpu))} ({_pct(min(d_cpu))} to "
        f"{_pct(max(d_cpu))}), p50 {statistics.median(d_p50):+.2f} ms, "
        f"p99 {statistics.median(d_p99):+.2f} ms ({min(d_p99):+.2f} to {max(d_p99):+.2f})"
    )


async def _request_loop(
    targets: dict[str, str],
    payload: bytes,
    offsets_s: Sequence[float],
    sends: Sequence[Sequence[str]],
    timeout_s: float,
    seed: int,
) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """At each offset `i` one request to every target of `sends[i]`, in a fresh random order.

    Every latency is kept, indexed by instant: NaN where a target was sent nothing, inf where
    its request failed (so it counts as infinitely slow). A request is timed from its own send,
    not from its instant in the schedule: partners at one instant go out microseconds apart,
    and a late wake-up of this client is not counted against the server.
    """
    shuffle = random.Random(seed).shuffle
    latencies = {label: np.full(len(offsets_s), np.nan) for label in targets}
    codes: dict[str, list[str]] = {label: [] for label in targets}
    channels = {label: grpc.aio.insecure_channel(target) for label, target in targets.items()}
    try:
        # No serializers: the request goes as pre-built bytes, the reply stays undecoded.
        calls = {label: ch.unary_unary(MODEL_INFER_METHOD) for label, ch in channels.items()}
        for channel in channels.values():
            await channel.channel_ready()
        loop = asyncio.get_running_loop()
        t0 = loop.time() + START_MARGIN_S
        in_flight: set[asyncio.Task] = set()

        async def one(label: str, i: int) -> None:
            sent = loop.time()
            try:
                await calls[label](payload, timeout=timeout_s)
                latencies[label][i] = loop.time() - sent
            except grpc.aio.AioRpcError as exc:
                latencies[label][i] = np.inf
                codes[label].append(exc.code().name)

        for i, offset in enumerate(offsets_s):
            delay = t0 + offset - loop.time() - EARLY_WAKE_S
            if delay > 0:
                await asyncio.sleep(delay)
            order = list(sends[i])
            shuffle(order)
            for label in order:  # tasks start in the order they were made
                task = asyncio.create_task(one(label, i))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.wait(in_flight)
    finally:
        for channel in channels.values():
            await channel.close()
    return latencies, codes


def _quantile_ms(latencies_s: np.ndarray, q: float) -> float:
    """The q-th percentile of the requests sent (NaN: none sent at that instant), in ms.

    A sample's own value (no interpolation), so a failed request's inf stays meaningful; NaN
    where nothing was sent (a short run's resample can draw only another server's turns).
    """
    sent = latencies_s[~np.isnan(latencies_s)]
    if sent.size == 0:
        return math.nan
    return float(np.percentile(sent, q, method="inverted_cdf")) * 1e3


def block_bootstrap(
    legs: np.ndarray,
    blocks: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    q: float,
    resamples: int,
    seed: int = 7,
) -> tuple[float, float, float]:
    """The q-th percentile of `a` minus that of `b` (ms), and its 95 % bootstrap interval.

    `a[i]` and `b[i]` belong to instant `i`, in block `blocks[i]` of leg `legs[i]` (each leg
    its own server processes); NaN where that side was sent nothing. Two levels: each resample
    draws as many legs as there are, with replacement, then within each drawn leg as many of
    its blocks as it has, and takes the same instants from both sides, so the machine's slow
    stretches (which last seconds) stay paired and the differences between one set of server
    processes and the next count as well.
    """
    members = [
        [
            np.flatnonzero((legs == leg) & (blocks == block))
            for block in np.unique(blocks[legs == leg])
        ]
        for leg in np.unique(legs)
    ]
    rng = np.random.default_rng(seed)
    diffs = np.empty(resamples)
    for r in range(resamples):
        parts: list[np.ndarray] = []
        for leg in rng.integers(0, len(members), len(members)):
            parts.extend(
                members[leg][k] for k in rng.integers(0, len(members[leg]), len(members[leg]))
            )
        index = np.concatenate(parts)
        diffs[r] = _quantile_ms(a[index], q) - _quantile_ms(b[index], q)
    # Resamples that drew nothing from one side (only in runs of a round or two) are left out.
    low, high = np.percentile(diffs[~np.isnan(diffs)], [2.5, 97.5], method="inverted_cdf")
    return _quantile_ms(a, q) - _quantile_ms(b, q), float(low), float(high)


Schedule = Callable[[int, np.ndarray], tuple[list[list[str]], np.ndarray]]


def _every_server(labels: list[str], block_s: float) -> Schedule:
    """Part 3: every instant goes to every server; bootstrap blocks of `block_s` seconds."""

    def schedule(leg: int, offsets: np.ndarray) -> tuple[list[list[str]], np.ndarray]:
        return [labels] * len(offsets), (offsets // block_s).astype(np.int64)

    return schedule


def _taking_turns(labels: list[str], slot_s: float) -> Schedule:
    """Part 4: each slot of `slot_s` seconds goes to one server alone. Slots come in rounds of
    one slot a server, in a fresh random order each round; a round is a bootstrap block."""

    def schedule(leg: int, offsets: np.ndarray) -> tuple[list[list[str]], np.ndarray]:
        slots = (offsets // slot_s).astype(np.int64)
        rounds = slots // len(labels)
        rng = random.Random(1000 + leg)
        orders = [rng.sample(labels, len(labels)) for _ in range(int(rounds.max(initial=0)) + 1)]
        sends = [[orders[r][s % len(labels)]] for r, s in zip(rounds, slots, strict=True)]
        return sends, rounds

    return schedule


@dataclasses.dataclass
class Legs:
    """Every request of a part 3 or 4 run, by instant: what its report reads, and what
    `--save` keeps so that later runs can be pooled with it (`--pool`)."""

    legs: np.ndarray  # each instant's leg
    blocks: np.ndarray  # its bootstrap block, within its leg
    latencies: dict[str, np.ndarray]  # seconds, by server; NaN: sent nothing, inf: failed
    failed: dict[str, dict[str, int]]  # failed requests by server and status code
    cpu_s: dict[str, float]  # server CPU seconds over the timed legs
    took_s: float
    kept_traces: int | None = None  # server spans the tracing-on server wrote, with --export
    # How it ran (part, rate, budget, export, slot or block): only like runs are pooled.
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    seeds: list[int] = dataclasses.field(default_factory=list)

    def save(self, path: Path) -> None:
        meta = {
            "labels": list(self.latencies),
            "settings": self.settings,
            "seeds": self.seeds,
            "failed": self.failed,
            "cpu_s": self.cpu_s,
            "took_s": self.took_s,
            "kept_traces": self.kept_traces,
        }
        arrays: dict[str, Any] = {f"latency_{label}": lat for label, lat in self.latencies.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            path, legs=self.legs, blocks=self.blocks, meta=np.array(json.dumps(meta)), **arrays
        )

    @classmethod
    def load(cls, path: Path) -> Legs:
        with np.load(path, allow_pickle=False) as saved:
            meta = json.loads(str(saved["meta"]))
            return cls(
                legs=saved["legs"],
                blocks=saved["blocks"],
                latencies={label: saved[f"latency_{label}"] for label in meta["labels"]},
                failed=meta["failed"],
                cpu_s=meta["cpu_s"],
                took_s=meta["took_s"],
                kept_traces=meta["kept_traces"],
                settings=meta["settings"],
                seeds=meta["seeds"],
            )

    @classmethod
    def pooled(cls, runs: Sequence[Legs]) -> Legs:
        """Runs as one, each run's legs numbered after the last one's; the servers all share.

        Runs made with other settings measure other things, and a seed met twice is most likely
        one run given twice: ValueError for either."""
        unlike = {json.dumps(r.settings, sort_keys=True) for r in runs}
        if len(unlike) > 1:
            raise ValueError(f"runs made with different settings: {' and '.join(sorted(unlike))}")
        seeds = [seed for r in runs for seed in r.seeds]
        if len(set(seeds)) < len(seeds):
            raise ValueError(f"a seed comes twice ({seeds}): the same run, or the same draws")
        labels = [label for label in runs[0].latencies if all(label in r.latencies for r in runs)]
        legs, first = [], 0
        for run in runs:
            legs.append(run.legs + first)
            first += int(run.legs.max(initial=-1)) + 1
        kept = [r.kept_traces for r in runs]
        return cls(
            legs=np.concatenate(legs),
            blocks=np.concatenate([r.blocks for r in runs]),
            latencies={lb: np.concatenate([r.latencies[lb] for r in runs]) for lb in labels},
            failed={
                lb: dict(sum((Counter(r.failed[lb]) for r in runs), Counter())) for lb in labels
            },
            cpu_s={lb: sum(r.cpu_s[lb] for r in runs) for lb in labels},
            took_s=sum(r.took_s for r in runs),
            kept_traces=None if None in kept else sum(k for k in kept if k is not None),
            settings=runs[0].settings,
            seeds=seeds,
        )


def in_legs(
    args: argparse.Namespace,
    total_s: float,
    schedule_for: Callable[[list[str]], Schedule],
    settings: dict[str, Any],
) -> Legs:
    """Tracing on and off (and, with --control, a second off) driven by one Poisson schedule
    at `--rate-rps` in `--legs` legs, each with server processes of its own, started in a fresh
    order; `schedule_for` says which servers each instant goes to, and the bootstrap blocks."""
    onnx_path = resolve_model_path(None)
    io = read_model_io(onnx_path)
    plan = LoadPlan(target="")  # the load generator's request: its model, history and seed
    arrays = make_request_arrays(io, plan.history_len, seed=plan.seed)
    payload = build_infer_request(plan.model_name, arrays, io.output).SerializeToString()
    labels = ["on", "off"] + (["off-2"] if args.control else [])
    schedule = schedule_for(labels)
    trace_file = RESULTS_DIR / "logs" / "tracing-overhead-traces.jsonl" if args.export else None
    warm_up = poisson_offsets(args.rate, 5.0, 10_000, seed=12)
    timeout_s = args.riskserve_budget_ms / 1e3
    leg_s = total_s / args.legs
    legs, blocks = [], []
    latencies: dict[str, list[np.ndarray]] = {label: [] for label in labels}
    failed: dict[str, Counter[str]] = {label: Counter() for label in labels}
    cpu = dict.fromkeys(labels, 0.0)
    took = 0.0
    kept_servers = 0  # server spans the tracing-on server wrote (warm-up included), --export
    for leg in range(args.legs):
        key = args.seed * 1000 + leg  # each leg's own draws, and another run's with --seed
        leg_offsets = poisson_offsets(args.rate, leg_s, 10_000_000, seed=11 + key)
        sends, leg_blocks = schedule(key, leg_offsets)
        order = random.Random(key).sample(labels, len(labels))
        with contextlib.ExitStack() as stack:
            if trace_file is not None:
                trace_file.unlink(missing_ok=True)  # each leg's kept traces, not every run's
            servers = _start_servers(
                stack, order, args.riskserve_budget_ms, _tracing_env(args, trace_file)
            )
            targets = {label: servers[label].target for label in labels}
            asyncio.run(
                _request_loop(
                    targets, payload, warm_up.tolist(), [labels] * len(warm_up), timeout_s, 3
                )
            )
            cpu_before = {label: server.cpu_seconds() for label, server in servers.items()}
            started = time.monotonic()
            leg_latencies, leg_codes = asyncio.run(
                _request_loop(targets, payload, leg_offsets.tolist(), sends, timeout_s, 4 + key)
            )
            took += time.monotonic() - started
            for label, server in servers.items():
                cpu[label] += server.cpu_seconds() - cpu_before[label]
        if trace_file is not None and trace_file.exists():  # flushed as the server stopped
            with trace_file.open(encoding="utf-8") as lines:
                kept_servers += sum('"kind": "SERVER"' in line for line in lines)
        legs.append(np.full(len(leg_offsets), leg))
        blocks.append(leg_blocks)
        for label in labels:
            latencies[label].append(leg_latencies[label])
            failed[label].update(leg_codes[label])
        p99 = {label: _quantile_ms(leg_latencies[label], 99) for label in labels}
        print(
            f"   leg {leg + 1} (started {', '.join(order)}): p99 "
            + "  ".join(f"{label} {value:.3f}" for label, value in p99.items())
            + " ms; "
            + "  ".join(f"{a} - off {p99[a] - p99['off']:+.3f}" for a in labels if a != "off")
            + " ms",
            flush=True,
        )
    return Legs(
        legs=np.concatenate(legs),
        blocks=np.concatenate(blocks),
        latencies={label: np.concatenate(parts) for label, parts in latencies.items()},
        failed={label: dict(counts) for label, counts in failed.items()},
        cpu_s=cpu,
        took_s=took,
        kept_traces=kept_servers if trace_file is not None else None,
        settings={
            **settings,
            "rate_rps": args.rate,
            "budget_ms": args.riskserve_budget_ms,
            "export": args.export,
            # Only when set, so runs at the default pool with those saved before the option.
            **({"sample_ratio": args.sample_ratio} if args.sample_ratio is not None else {}),
            **({"export_batch": args.export_batch} if args.export_batch is not None else {}),
        },
        seeds=[args.seed],
    )


def report(run: Legs, resamples: int) -> None:
    """Each server's pooled p50/p99/p99.9 and CPU, and every difference from `off` with its
    bootstrap interval."""
    instants, legs = len(run.legs), len(np.unique(run.legs))
    print(
        f"   {instants} instants in {legs} legs, {run.took_s:.0f} s in all "
        f"({instants / run.took_s:.1f} instants/s); pooled over the legs, failed requests "
        f"counted as infinitely slow"
    )
    sent = {label: int(np.count_nonzero(~np.isnan(lat))) for label, lat in run.latencies.items()}
    for label, lat in run.latencies.items():
        failed = ", ".join(f"{code} {n}" for code, n in sorted(run.failed[label].items()))
        print(
            f"   {label:6} {sent[label]} requests  p50 {_quantile_ms(lat, 50):6.3f} ms  "
            f"p99 {_quantile_ms(lat, 99):6.3f} ms  p99.9 {_quantile_ms(lat, 99.9):6.3f} ms  "
            f"server CPU {run.cpu_s[label] / sent[label] * 1e3:.3f} ms/req  "
            f"failed: {failed or 'none'}"
        )
    for a in run.latencies:
        if a == "off":
            continue
        for q in (50, 99):
            diff, low, high = block_bootstrap(
                run.legs, run.blocks, run.latencies[a], run.latencies["off"], q, resamples
            )
            print(
                f"   {a} - off, p{q}: {diff:+.3f} ms, 95 % interval {low:+.3f} to {high:+.3f} ms "
                f"({resamples} resamples of legs, then of blocks)"
            )
        per_request = (run.cpu_s[a] / sent[a]) / (run.cpu_s["off"] / sent["off"])
        print(f"   {a} - off, server CPU per request: {_pct(math.log(per_request))}")
    if run.kept_traces is not None:
        print(f"   the tracing-on server wrote {run.kept_traces} kept traces (warm-ups included)")


def _keep(run: Legs, args: argparse.Namespace) -> None:
    if args.save:
        run.save(args.save)  # before the report, which takes minutes of resampling
        print(f"   kept every latency in {args.save}")
    report(run, args.resamples)


def _pct(log_ratio: float) -> str:
    return f"{(math.exp(log_ratio) - 1) * 100:+.1f} %"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=8, help="end-to-end rounds (0: skip)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--rate-rps",
        dest="rate",
        type=float,
        default=150.0,
        help="per server (parts 2 and 3: all at once; part 4: in its turn)",
    )
    parser.add_argument(
        "--control", action="store_true", help="also pair two tracing-off servers (noise floor)"
    )
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument(
        "--paired-s", type=float, default=0.0, help="paired requests for this long (0: skip)"
    )
    parser.add_argument(
        "--legs",
        type=int,
        default=6,
        help="parts of --paired-s or --turns-s, each with fresh servers",
    )
    parser.add_argument(
        "--block-s", type=float, default=5.0, help="bootstrap block length (part 3)"
    )
    parser.add_argument(
        "--turns-s", type=float, default=0.0, help="servers taking turns for this long (0: skip)"
    )
    parser.add_argument(
        "--slot-s", type=float, default=2.0, help="how long each turn lasts (part 4)"
    )
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument(
        "--seed", type=int, default=0, help="draws of parts 3 and 4 (schedules, orders)"
    )
    parser.add_argument(
        "--riskserve-budget-ms",
        type=float,
        default=1000.0,
        help="each server's budget (its slow-trace threshold is half of it)",
    )
    parser.add_argument(
        "--export",
        action="store_true",
        help="parts 3 and 4: the tracing-on server writes kept traces to a JSON-lines file",
    )
    parser.add_argument(
        "--sample-ratio",
        type=float,
        help="parts 3 and 4: the tracing-on server's share of fast traces kept (default 0.01)",
    )
    parser.add_argument(
        "--export-batch",
        type=int,
        help="parts 3 and 4: the most spans the tracing-on server exports at once "
        "(OTEL_BSP_MAX_EXPORT_BATCH_SIZE; default 64)",
    )
    parser.add_argument(
        "--save", type=Path, help="part 3 or 4: keep every latency in this .npz file, to pool"
    )
    parser.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        help="report runs kept with --save as one (each run's legs apart), and run nothing",
    )
    args = parser.parse_args(argv)
    if args.save and args.paired_s > 0 and args.turns_s > 0:
        parser.error("--save keeps one part's latencies: run part 3 or part 4, not both")
    if args.pool:
        runs = [Legs.load(path) for path in args.pool]
        try:
            pooled = Legs.pooled(runs)
        except ValueError as exc:
            parser.error(str(exc))
        print(f"pooled: {', '.join(str(path) for path in args.pool)}")
        print(f"   {pooled.settings}, seeds {pooled.seeds}")
        report(pooled, args.resamples)
        return 0

    print("1. recording cost per request (median of interleaved repeats)")
    costs = recording(args.requests, args.repeats)
    for name, seconds in costs.items():
        print(f"   {name:42} {seconds * 1e6:6.2f} µs")
    if args.rounds > 0:
        print("2. live servers driven at once, tracing on against off (perf_analyzer, same cores)")
        results = end_to_end(args)
        for mode, load in (("concurrency", args.concurrency), ("rate", args.rate)):
            print(_summary(results, mode, load, "on", "off"))
            if args.control:
                print(_summary(results, mode, load, "off-2", "off"))
    if args.paired_s > 0:
        print(f"3. paired requests at {args.rate:g} req/s to each server, tracing on against off")
        run = in_legs(
            args,
            args.paired_s,
            lambda labels: _every_server(labels, args.block_s),
            {"part": "paired requests", "block_s": args.block_s},
        )
        _keep(run, args)
    if args.turns_s > 0:
        print(
            f"4. servers taking turns at {args.rate:g} req/s, one at a time in "
            f"{args.slot_s:g} s slots, tracing on against off"
        )
        run = in_legs(
            args,
            args.turns_s,
            lambda labels: _taking_turns(labels, args.slot_s),
            {"part": "servers taking turns", "slot_s": args.slot_s},
        )
        _keep(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
