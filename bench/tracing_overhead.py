"""What tracing costs: the request path's recording alone, and a live server on against off.

1. Recording, in process: the calls one scored request makes on `Tracing` (start, the
   validation stage, the deferred scoring details, its share of a batch of 8, end) with the
   deployed policy (ratio 0.01: almost every fast trace dropped) and with every trace kept and
   exported, against the plain SDK's cost of starting and ending the two spans a request would
   need. Median of interleaved repeats.
2. End to end: riskserve with tracing on and off (RISKSERVE_TRACING), both running and driven
   at the same moment, each by its own perf_analyzer, for `--rounds` rounds: at closed-loop
   concurrency `--concurrency` (the most each serves while sharing the cores) and at the
   open-loop rate `--rate-rps` per server (a moderate load in all). Throughput, p50/p99 and
   server CPU per request, medians over the rounds, and the median of the per-round on-off
   differences. `--control` adds a pair of two tracing-off servers: the differences the
   machine makes by itself, to read the on-off differences against.

    .venv/bin/python -m bench.tracing_overhead --rounds 8 --rate-rps 150 --control
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind

from bench.compare import RESULTS_DIR, riskserve_knobs, server_spec
from bench.model_io import resolve_model_path
from bench.perf_analyzer import PerfAnalyzer, PerfPlan
from bench.results import PointResult
from bench.servers import ServerProcess
from service.telemetry import RequestTrace, TailSamplingPolicy, Tracing

BATCH_REQUESTS = 8


class DiscardingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _tracing(**policy: object) -> Tracing:
    values: dict = {"slow_threshold_ns": 5_000_000, "sample_ratio": 0.01}
    values.update(policy)
    return Tracing(
        TailSamplingPolicy(**values),
        BatchSpanProcessor(DiscardingExporter(), max_queue_size=1 << 16),
        Resource.create({}),
        InstrumentationScope("bench"),
    )


def _record(tracing: Tracing, requests: int) -> float:
    """Seconds per request for the recording the request path does."""
    started = time.perf_counter()
    for _ in range(requests // BATCH_REQUESTS):
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
    return (time.perf_counter() - started) / requests


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
    provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(DiscardingExporter(), max_queue_size=1 << 16))
    runs: dict[str, Callable[[], float]] = {
        "riskserve tracing, ratio 0.01 (deployed)": lambda: _record(_tracing(), requests),
        "riskserve tracing, every trace exported": lambda: _record(
            _tracing(export_all=True), requests
        ),
        "SDK spans, 2 per request, all exported": lambda: _sdk_spans(provider, requests),
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
    knobs = riskserve_knobs(args.riskserve_budget_ms)
    kinds = {"on": "riskserve", "off": "riskserve-notrace", "off-2": "riskserve-notrace"}
    pairs = [("on", "off")] + ([("off-2", "off")] if args.control else [])
    results: Runs = {}
    with contextlib.ExitStack() as stack:
        runners: dict[str, tuple[PerfAnalyzer, ServerProcess]] = {}
        for label in {name for pair in pairs for name in pair}:
            spec = server_spec(kinds[label], onnx_path, knobs)
            log_path = RESULTS_DIR / "logs" / f"tracing-overhead-{label}.log"
            server = stack.enter_context(ServerProcess(spec, log_path))
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


def _pct(log_ratio: float) -> str:
    return f"{(math.exp(log_ratio) - 1) * 100:+.1f} %"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=8, help="end-to-end rounds (0: skip)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--rate-rps", dest="rate", type=float, default=150.0, help="per server, both at once"
    )
    parser.add_argument(
        "--control", action="store_true", help="also pair two tracing-off servers (noise floor)"
    )
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--riskserve-budget-ms", type=float, default=1000.0)
    args = parser.parse_args(argv)

    print("1. recording cost per request (median of interleaved repeats)")
    costs = recording(args.requests, args.repeats)
    for name, seconds in costs.items():
        print(f"   {name:42} {seconds * 1e6:6.2f} µs")
    if args.rounds <= 0:
        return 0
    print("2. live servers driven at once, tracing on against off (perf_analyzer, same cores)")
    results = end_to_end(args)

    for mode, load in (("concurrency", args.concurrency), ("rate", args.rate)):
        print(_summary(results, mode, load, "on", "off"))
        if args.control:
            print(_summary(results, mode, load, "off-2", "off"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
