"""The tail sampler on its own: bounds, batch-span linking, the ratio, late children."""

from __future__ import annotations

import random
import time

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from service.telemetry import (
    SAMPLED_REASON_ATTRIBUTE,
    TailSamplingPolicy,
    TailSamplingProcessor,
    batch_span,
)

MS = 1_000_000


class SeededIds(IdGenerator):
    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1


def _pipeline(seed: int = 1, **policy):
    exporter = InMemorySpanExporter()
    decisions: list[str] = []
    defaults = {"slow_threshold_ns": 5 * MS, "sample_ratio": 0.0}
    defaults.update(policy)
    sampler = TailSamplingProcessor(
        SimpleSpanProcessor(exporter), TailSamplingPolicy(**defaults), decisions.append
    )
    provider = TracerProvider(
        sampler=ALWAYS_ON, id_generator=SeededIds(seed), shutdown_on_exit=False
    )
    provider.add_span_processor(sampler)
    return provider.get_tracer("test"), sampler, exporter, decisions


def _trace(tracer, duration_ns: int = 0, error: bool = False, children: int = 1):
    start = time.time_ns()
    root = tracer.start_span("root", start_time=start)
    with trace.use_span(root, end_on_exit=False):
        for _ in range(children):
            tracer.start_span("child").end()
    if error:
        root.set_status(Status(StatusCode.ERROR))
    root.end(end_time=start + duration_ns)
    return root


def test_keeps_slow_and_error_trees_whole_and_drops_fast_ones():
    tracer, sampler, exporter, decisions = _pipeline()
    _trace(tracer, duration_ns=1 * MS)
    slow = _trace(tracer, duration_ns=6 * MS, children=3)
    failed = _trace(tracer, error=True)
    assert decisions == ["dropped", "slow", "error"]
    spans = exporter.get_finished_spans()
    assert len(spans) == 4 + 2
    assert {s.context.trace_id for s in spans} == {
        slow.get_span_context().trace_id,
        failed.get_span_context().trace_id,
    }
    roots = [s for s in spans if s.parent is None]
    assert sorted(s.attributes[SAMPLED_REASON_ATTRIBUTE] for s in roots) == ["error", "slow"]
    assert sampler.stats().open_traces == 0


def test_an_error_in_a_child_keeps_the_trace():
    tracer, _, exporter, decisions = _pipeline()
    root = tracer.start_span("root")
    with trace.use_span(root, end_on_exit=True):
        child = tracer.start_span("child")
        child.set_status(Status(StatusCode.ERROR))
        child.end()
    assert decisions == ["error"]
    assert len(exporter.get_finished_spans()) == 2


def test_ratio_keeps_the_configured_share_of_fast_traces():
    tracer, sampler, _, decisions = _pipeline(seed=42, sample_ratio=0.25)
    n = 4000
    for _ in range(n):
        _trace(tracer, children=0)
    kept = decisions.count("ratio")
    # Binomial(4000, 0.25): sd = 27.4; allow 4 sd.
    assert abs(kept - n * 0.25) < 4 * 27.4
    assert sampler.stats().kept_by_reason == {"ratio": kept}
    assert sampler.stats().dropped_traces == n - kept


def test_open_traces_and_spans_per_trace_are_bounded():
    tracer, sampler, exporter, _ = _pipeline(max_open_traces=10, max_spans_per_trace=3)
    leaked = [tracer.start_span("never-ends") for _ in range(50)]
    stats = sampler.stats()
    assert stats.open_traces == 10
    assert stats.overflow_traces == 40
    for span in leaked:
        span.end()
    assert sampler.stats().open_traces == 0

    root = tracer.start_span("root")
    with trace.use_span(root, end_on_exit=False):
        for _ in range(8):
            tracer.start_span("child").end()
    root.set_status(Status(StatusCode.ERROR))
    root.end()
    exported = [
        s for s in exporter.get_finished_spans() if s.context.trace_id == root.context.trace_id
    ]
    assert len(exported) == 3 + 1
    kept_root = next(s for s in exported if s.parent is None)
    assert kept_root.attributes["riskserve.dropped_spans"] == 5
    assert sampler.stats().overflow_spans == 5


def test_nothing_is_held_after_many_traces():
    tracer, sampler, _, _ = _pipeline(max_open_traces=100)
    for _ in range(1000):
        _trace(tracer, children=5)
    stats = sampler.stats()
    assert stats.open_traces == 0
    assert stats.pending_batch_traces == 0
    assert stats.overflow_traces == 0
    assert len(sampler._root_of) == 0


def test_batch_span_is_kept_with_a_kept_request_and_dropped_with_dropped_ones():
    tracer, sampler, exporter, decisions = _pipeline()
    fast = tracer.start_span("request-fast")
    slow_start = time.time_ns()
    slow = tracer.start_span("request-slow", start_time=slow_start)
    links = [fast.get_span_context(), slow.get_span_context()]
    with batch_span(tracer, links, {"n": 2}):
        tracer.start_span("engine").end()
    assert sampler.stats().pending_batch_traces == 1
    fast.end()
    assert sampler.stats().pending_batch_traces == 1  # still waits on the slow request
    slow.end(end_time=slow_start + 10 * MS)
    assert decisions == ["dropped", "slow", "linked"]
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["engine", "request-slow", "riskserve.batch"]
    batch = next(s for s in exporter.get_finished_spans() if s.name == "riskserve.batch")
    assert batch.parent is None
    assert batch.attributes[SAMPLED_REASON_ATTRIBUTE] == "linked"
    assert {link.context.span_id for link in batch.links} == {
        fast.get_span_context().span_id,
        slow.get_span_context().span_id,
    }

    exporter.clear()
    lone = tracer.start_span("request")
    with batch_span(tracer, [lone.get_span_context()]):
        pass
    lone.end()
    assert exporter.get_finished_spans() == ()
    assert decisions[-2:] == ["dropped", "dropped"]
    assert sampler.stats().pending_batch_traces == 0


def test_batch_linking_a_request_already_kept_is_exported_at_once():
    tracer, _, exporter, decisions = _pipeline()
    request = tracer.start_span("request")
    request.set_status(Status(StatusCode.ERROR))
    request.end()
    with batch_span(tracer, [request.get_span_context()]):
        pass
    assert decisions == ["error", "linked"]
    assert len(exporter.get_finished_spans()) == 2


def test_pending_batches_are_bounded():
    tracer, sampler, _, _ = _pipeline(max_pending_batch_traces=4)
    requests = [tracer.start_span("request") for _ in range(10)]
    for request in requests:
        with batch_span(tracer, [request.get_span_context()]):
            pass
    stats = sampler.stats()
    assert stats.pending_batch_traces == 4
    assert stats.evicted_batch_traces == 6
    for request in requests:
        request.end()
    assert sampler.stats().pending_batch_traces == 0


def test_a_child_ending_after_its_kept_root_is_still_exported():
    tracer, _, exporter, _ = _pipeline()
    start = time.time_ns()
    root = tracer.start_span("root", start_time=start)
    with trace.use_span(root, end_on_exit=False):
        late = tracer.start_span("late")
    root.end(end_time=start + 10 * MS)
    late.end()
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["late", "root"]


def test_two_local_roots_in_one_caller_trace_are_decided_apart():
    tracer, _, exporter, _ = _pipeline()
    caller = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(0))
    parent = trace.set_span_in_context(NonRecordingSpan(caller))
    start = time.time_ns()
    fast = tracer.start_span("fast", context=parent)
    slow = tracer.start_span("slow", context=parent, start_time=start)
    with trace.use_span(slow, end_on_exit=False):
        tracer.start_span("slow-child").end()
    with trace.use_span(fast, end_on_exit=False):
        tracer.start_span("fast-child").end()
    fast.end()
    slow.end(end_time=start + 10 * MS)
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["slow", "slow-child"]
