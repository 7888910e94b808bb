"""Per-span cost of the in-process tail sampler.

Each trace is a root with `--children` child spans (a fast, OK request, the common case:
dropped at ratio 0.01). Two measurements:

- replay: spans recorded once are fed through the processor's on_start/on_end in trace order,
  timing the processor alone (downstream discards), so span creation and machine noise from
  the SDK itself stay out;
- end to end: start + end of real spans with no processor, plain BatchSpanProcessor export of
  everything, and the tail sampler in front of the same BatchSpanProcessor.

    python bench/tracing_overhead.py [--traces 20000] [--children 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from service.telemetry import TailSamplingPolicy, TailSamplingProcessor


class DiscardingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _provider(kind: str) -> TracerProvider:
    provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)
    export = BatchSpanProcessor(DiscardingExporter(), max_queue_size=1 << 16)
    if kind == "tail":
        policy = TailSamplingPolicy(slow_threshold_ns=5_000_000, sample_ratio=0.01)
        provider.add_span_processor(TailSamplingProcessor(export, policy))
    elif kind == "batch":
        provider.add_span_processor(export)
    return provider


def _run(tracer: trace.Tracer, traces: int, children: int) -> float:
    """Seconds for `traces` traces of 1 + `children` spans."""
    started = time.perf_counter()
    for _ in range(traces):
        root = tracer.start_span("root", kind=trace.SpanKind.SERVER)
        context = trace.set_span_in_context(root)
        for _ in range(children):
            tracer.start_span("child", context=context).end()
        root.end()
    return time.perf_counter() - started


def measure(kind: str, traces: int, children: int, repeats: int) -> float:
    provider = _provider(kind)
    tracer = provider.get_tracer("bench")
    _run(tracer, traces // 10, children)  # warm up
    best_s = min(_run(tracer, traces, children) for _ in range(repeats))
    provider.shutdown()
    return best_s / (traces * (1 + children)) * 1e9


def _recorded_traces(traces: int, children: int) -> list[list[Span]]:
    """Ended spans per trace, root first, recorded with no processor attached."""
    tracer = _provider("none").get_tracer("bench")
    recorded = []
    for _ in range(traces):
        root = tracer.start_span("root", kind=trace.SpanKind.SERVER)
        context = trace.set_span_in_context(root)
        spans: list[Span] = [root]
        for _ in range(children):
            child = tracer.start_span("child", context=context)
            child.end()
            spans.append(child)
        root.end()
        recorded.append(spans)
    return recorded


def replay_ns_per_span(recorded: list[list[Span]], repeats: int) -> float:
    """The processor's on_start + on_end per span, median of `repeats` passes."""
    per_span_ns = []
    spans_total = sum(len(spans) for spans in recorded)
    for _ in range(repeats):
        policy = TailSamplingPolicy(slow_threshold_ns=5_000_000, sample_ratio=0.01)
        processor = TailSamplingProcessor(SpanProcessor(), policy)
        on_start, on_end = processor.on_start, processor.on_end
        started = time.perf_counter_ns()
        for root, *children in recorded:
            on_start(root)
            for child in children:
                on_start(child)
                on_end(child)
            on_end(root)
        per_span_ns.append((time.perf_counter_ns() - started) / spans_total)
    return statistics.median(per_span_ns)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=20000)
    parser.add_argument("--children", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    recorded = _recorded_traces(args.traces, args.children)
    replay_ns = replay_ns_per_span(recorded, args.repeats)
    print(f"spans per trace: {1 + args.children}, traces per run: {args.traces}")
    print(f"replay: tail sampler on_start + on_end: {replay_ns:.0f} ns per span (median)")
    results: dict[str, list[float]] = {"none": [], "batch": [], "tail": []}
    run: Callable[[str], float] = lambda kind: measure(  # noqa: E731
        kind, args.traces, args.children, args.repeats
    )
    # Interleave the pipelines so drift in machine load hits them alike.
    for _ in range(3):
        for kind in results:
            results[kind].append(run(kind))
    median = {kind: statistics.median(values) for kind, values in results.items()}
    for kind, ns in median.items():
        print(f"end to end, {kind:>5}: {ns:8.0f} ns per span (start + end, median)")
    print(f"tail sampler overhead over no processor: {median['tail'] - median['none']:.0f} ns/span")
    print(
        f"plain batch export overhead:             {median['batch'] - median['none']:.0f} ns/span"
    )


if __name__ == "__main__":
    main()
