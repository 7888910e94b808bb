"""What tracing costs: the request path's recording alone, and a live server on against off.

1. Recording, in process: the calls one scored request makes on `Tracing` (start, three stage
   records, its share of a batch of 8, end) with the deployed policy (ratio 0.01: almost every
   fast trace dropped) and with every trace kept and exported, against the plain SDK's cost of
   starting and ending the two spans a request would need. Median of interleaved repeats.
2. End to end: riskserve with tracing on and off (RISKSERVE_TRACING), both running, driven in
   turn by perf_analyzer for `--rounds` rounds (the order flips each round), at closed-loop
   concurrency `--concurrency` (the most it serves) and at the open-loop rate `--rate-rps` (a
   moderate load); throughput, p50/p99 and server CPU per request, medians over the rounds.

    .venv/bin/python -m bench.tracing_overhead --rounds 8 --rate-rps 300
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind

from bench.compare import RESULTS_DIR, Knobs, server_spec
from bench.model_io import resolve_model_path
from bench.perf_analyzer import PerfAnalyzer, PerfPlan
from bench.results import PointResult
from bench.servers import ServerProcess
from service.telemetry import TailSamplingPolicy, Tracing

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
            trace.add_stage("riskserve.queue", now, now + 20_000)
            trace.add_stage("riskserve.score", now, now + 30_000, {"riskserve.batch.size": 8})
            trace.batch = batch
            trace.attributes["riskserve.model"] = "fraud-demo"
            tracing.end_request(trace, 0)
    return (time.perf_counter() - started) / requests


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


def end_to_end(args: argparse.Namespace) -> dict[str, list[tuple[PointResult, float]]]:
    """Both servers run side by side; the load alternates between them, round after round.

    On a shared machine the noise drifts over minutes: alternating short runs against two
    live servers lets each round's pair see about the same machine.
    """
    onnx_path = resolve_model_path(None)
    knobs = Knobs(64, 200, 0.0005, 1, args.riskserve_budget_ms)
    names = ("riskserve", "riskserve-notrace")
    results: dict[str, list[tuple[PointResult, float]]] = {}
    with contextlib.ExitStack() as stack:
        analyzers = {}
        for name in names:
            spec = server_spec(name, onnx_path, knobs)
            server = stack.enter_context(ServerProcess(spec, RESULTS_DIR / "logs" / f"{name}.log"))
            plan = PerfPlan(target=server.target, window_s=args.window_s, windows=3)
            analyzer = stack.enter_context(PerfAnalyzer(plan, onnx_path, server_label=name))
            analyzer.run_point("concurrency", 4)  # warm-up
            analyzers[name] = (analyzer, server)
        for round_ in range(args.rounds):
            for mode, load in (("concurrency", args.concurrency), ("rate", args.rate)):
                order = names if round_ % 2 == 0 else names[::-1]
                for name in order:
                    analyzer, server = analyzers[name]
                    point, cpu_s = _point(analyzer, mode, load, server.cpu_seconds)
                    results.setdefault(f"{name} {mode} {load:g}", []).append((point, cpu_s))
                    print(
                        f"round {round_ + 1} {name:18} {mode:11} {load:>5g}: "
                        f"{point.throughput_rps:7.1f} req/s  p50 {point.p50_ms:6.2f}  "
                        f"p99 {point.p99_ms:6.2f} ms  server CPU "
                        f"{_cpu_ms(point, cpu_s):.3f} ms/req",
                        flush=True,
                    )
    return results


def _cpu_ms(point: PointResult, cpu_s: float) -> float:
    # CPU over the whole perf_analyzer run (3 windows plus its start), per request it sent
    # in the windows: an upper bound, equally so for both servers.
    total = point.throughput_rps * point.duration_s * 3
    return cpu_s / total * 1e3 if total else float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=8, help="end-to-end rounds (0: skip)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate-rps", dest="rate", type=float, default=300.0)
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--riskserve-budget-ms", type=float, default=1000.0)
    args = parser.parse_args(argv)

    print("1. recording cost per request (median of interleaved repeats)")
    costs = recording(args.requests, args.repeats)
    for name, seconds in costs.items():
        print(f"   {name:42} {seconds * 1e6:6.2f} µs")
    if args.rounds <= 0:
        return 0
    print("2. live server, tracing on against off (perf_analyzer on the same cores)")
    results = end_to_end(args)

    def median(key: str, value: Callable[[PointResult, float], float]) -> float:
        return statistics.median(value(p, c) for p, c in results[key])

    for mode, load in (("concurrency", args.concurrency), ("rate", args.rate)):
        on, off = f"riskserve {mode} {load:g}", f"riskserve-notrace {mode} {load:g}"
        tput_on = median(on, lambda p, c: p.throughput_rps)
        tput_off = median(off, lambda p, c: p.throughput_rps)
        p99_on = median(on, lambda p, c: p.p99_ms)
        p99_off = median(off, lambda p, c: p.p99_ms)
        cpu_on = median(on, lambda p, c: _cpu_ms(p, c))
        cpu_off = median(off, lambda p, c: _cpu_ms(p, c))
        # Paired by round: each round's two runs saw about the same machine.
        paired_p99 = statistics.median(
            a.p99_ms - b.p99_ms for (a, _), (b, _) in zip(results[on], results[off], strict=True)
        )
        paired_tput = statistics.median(
            a.throughput_rps / b.throughput_rps - 1
            for (a, _), (b, _) in zip(results[on], results[off], strict=True)
        )
        print(
            f"   {mode} {load:g}: throughput on/off {tput_on:.1f}/{tput_off:.1f} req/s "
            f"({(tput_on / tput_off - 1) * 100:+.1f} %), p99 on/off {p99_on:.2f}/{p99_off:.2f} "
            f"ms ({p99_on - p99_off:+.2f} ms), server CPU on/off {cpu_on:.3f}/{cpu_off:.3f} "
            f"ms/req ({(cpu_on / cpu_off - 1) * 100:+.1f} %); paired by round, median "
            f"throughput change {paired_tput * 100:+.1f} %, p99 change {paired_p99:+.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
