"""The tail sampler on its own: the rules, stage and batch spans, the ratio, nothing held."""

from __future__ import annotations

import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, StatusCode

from service.telemetry import (
    BATCH_SPAN_NAME,
    SAMPLED_REASON_ATTRIBUTE,
    TailSamplingPolicy,
    Tracing,
)
from service.telemetry import tracing as tracing_module

MS = 1_000_000
# The slow threshold is a minute: a request here that is not made slow takes microseconds, and
# no loaded machine stretches that to a minute. A slow one is made to have taken two minutes.
SLOW_NS = 60_000 * MS
TOOK_SLOW_NS = 2 * SLOW_NS
OK, NOT_FOUND = 0, 5
CALLER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"


def _tracing(**policy) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    values = {"slow_threshold_ns": SLOW_NS, "sample_ratio": 0.0}
    values.update(policy)
    tracing = Tracing(
        TailSamplingPolicy(**values),
        SimpleSpanProcessor(exporter),
        Resource.create({"service.name": "test"}),
        InstrumentationScope("test"),
    )
    return tracing, exporter


def _request(tracing: Tracing, *, took_ns: int = 0, metadata=()):
    trace = tracing.start_request("svc/Method", {"rpc.method": "Method"}, metadata)
    trace.start_ns -= took_ns  # as if the call had started that much earlier
    return trace


def test_keeps_slow_and_error_traces_with_their_stages_and_drops_fast_ones():
    tracing, exporter = _tracing()
    slow = _request(tracing, took_ns=TOOK_SLOW_NS)
    now = time.monotonic_ns()
    slow.add_stage("riskserve.queue", now - 3 * MS, now - 1 * MS, {"k": 1})
    assert tracing.end_request(slow, OK) == "slow"
    failed = _request(tracing)
    assert tracing.end_request(failed, NOT_FOUND, "NOT_FOUND") == "error"
    fast = _request(tracing)
    fast.add_stage("riskserve.queue", now, now + 1000)
    assert tracing.end_request(fast, OK) == "dropped"

    spans = exporter.get_finished_spans()
    assert len(spans) == 3  # slow root + its stage, the failed root
    stage = next(s for s in spans if s.name == "riskserve.queue")
    root = next(s for s in spans if s.context.span_id == slow.span_id)
    assert stage.parent.span_id == root.context.span_id
    assert stage.context.trace_id == root.context.trace_id == slow.trace_id
    assert stage.end_time - stage.start_time == 2 * MS  # monotonic times convert exactly
    assert stage.attributes["k"] == 1
    assert root.kind is SpanKind.SERVER
    assert root.attributes[SAMPLED_REASON_ATTRIBUTE] == "slow"
    assert root.attributes["rpc.grpc.status_code"] == OK
    assert root.end_time - root.start_time >= TOOK_SLOW_NS
    error = next(s for s in spans if s.context.span_id == failed.span_id)
    assert error.status.status_code is StatusCode.ERROR
    assert error.status.description == "NOT_FOUND"
    assert error.attributes[SAMPLED_REASON_ATTRIBUTE] == "error"
    assert tracing.stats().kept_by_reason == {"slow": 1, "error": 1}
    assert tracing.stats().dropped_traces == 1


def test_a_caller_sampled_parent_is_kept_and_continued_an_unsampled_one_only_continued():
    tracing, exporter = _tracing()
    sampled = _request(
        tracing, metadata=[("traceparent", f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01")]
    )
    unsampled = _request(tracing, metadata=[("traceparent", f"00-{'1' * 32}-{CALLER_SPAN_ID}-00")])
    assert tracing.end_request(sampled, OK) == "parent"
    assert tracing.end_request(unsampled, OK) == "dropped"
    assert unsampled.trace_id == int("1" * 32, 16)
    (span,) = exporter.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == CALLER_TRACE_ID
    assert f"{span.parent.span_id:016x}" == CALLER_SPAN_ID
    assert span.parent.is_remote


def test_a_local_root_draws_valid_distinct_ids_and_redraws_a_zero(monkeypatch):
    tracing, _ = _tracing()
    traces = [_request(tracing) for _ in range(2000)]
    assert all(0 < t.trace_id < 1 << 128 and 0 < t.span_id < 1 << 64 for t in traces)
    assert len({t.trace_id for t in traces}) == len({t.span_id for t in traces}) == 2000

    # Both ids come from one 192-bit draw; a zero in either half is the invalid id.
    draws = iter([5 << 64, 7, 9])  # a zero span half, then the two redraws
    monkeypatch.setattr(tracing_module.random, "getrandbits", lambda bits: next(draws))
    redrawn = _request(tracing)
    assert (redrawn.trace_id, redrawn.span_id) == (7, 9)


def test_ratio_keeps_the_configured_share_of_fast_traces():
    tracing, _ = _tracing(sample_ratio=0.25)
    decisions = [tracing.end_request(_request(tracing), OK) for _ in range(4000)]
    kept = decisions.count("ratio")
    assert 800 <= kept <= 1200  # 1000 expected; 6 standard deviations is about 165
    assert kept + decisions.count("dropped") == 4000


def test_a_batch_span_is_exported_once_with_its_first_kept_request_and_links_them_all():
    tracing, exporter = _tracing()
    requests = [_request(tracing, took_ns=TOOK_SLOW_NS), _request(tracing), _request(tracing)]
    batch = tracing.start_batch([*requests, None], {"riskserve.batch.size": 4})
    batch.end({"riskserve.engine": "fake"})
    for request in requests:
        request.batch = batch
    reasons = [tracing.end_request(r, OK if i < 2 else NOT_FOUND) for i, r in enumerate(requests)]
    assert reasons == ["slow", "dropped", "error"]
    batches = [s for s in exporter.get_finished_spans() if s.name == BATCH_SPAN_NAME]
    assert len(batches) == 1
    (span,) = batches
    assert span.parent is None
    assert span.context.trace_id not in {r.trace_id for r in requests}
    assert {(link.context.trace_id, link.context.span_id) for link in span.links} == {
        (r.trace_id, r.span_id) for r in requests
    }
    assert span.attributes["riskserve.batch.size"] == 4
    assert span.attributes["riskserve.engine"] == "fake"


def test_a_batch_whose_requests_are_all_dropped_is_never_exported():
    tracing, exporter = _tracing()
    requests = [_request(tracing) for _ in range(3)]
    batch = tracing.start_batch(requests, {})
    batch.end({})
    for request in requests:
        request.batch = batch
        tracing.end_request(request, OK)
    assert exporter.get_finished_spans() == ()


def test_export_all_keeps_everything_without_a_reason_attribute():
    tracing, exporter = _tracing(export_all=True)
    for _ in range(5):
        assert tracing.end_request(_request(tracing), OK) == "all"
    spans = exporter.get_finished_spans()
    assert len(spans) == 5
    assert all(SAMPLED_REASON_ATTRIBUTE not in s.attributes for s in spans)


def test_nothing_is_held_between_requests():
    tracing, _ = _tracing(sample_ratio=0.5)
    open_now = [_request(tracing) for _ in range(10)]
    assert tracing.stats().open_traces == 10
    for trace in open_now:
        tracing.end_request(trace, OK)
    for _ in range(10_000):
        tracing.end_request(_request(tracing), OK)
    stats = tracing.stats()
    assert stats.open_traces == 0
    assert sum(stats.kept_by_reason.values()) + stats.dropped_traces == 10_010
    # The sampler's whole state is a few counters: no table grows with the traffic.
    assert len(vars(tracing)) == len(vars(_tracing()[0]))
    assert len(tracing.decisions()) <= 2


def test_deferred_details_run_on_export_only():
    tracing, exporter = _tracing()
    calls = []

    def details(trace, attributes, engine):
        calls.append(trace.span_id)
        attributes["riskserve.engine"] = engine
        now = time.monotonic_ns()
        trace.add_stage("riskserve.score", now - 2 * MS, now, {"riskserve.engine": engine})

    slow, fast = _request(tracing, took_ns=TOOK_SLOW_NS), _request(tracing)
    for trace in (slow, fast):
        trace.defer(details, "fake")
    assert tracing.end_request(fast, OK) == "dropped"
    assert calls == []  # a dropped trace never pays for its details
    assert tracing.end_request(slow, OK) == "slow"
    assert calls == [slow.span_id]

    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.context.span_id == slow.span_id)
    stage = next(s for s in spans if s.name == "riskserve.score")
    assert root.attributes["riskserve.engine"] == "fake"
    assert stage.parent.span_id == slow.span_id
    assert stage.attributes["riskserve.engine"] == "fake"
    assert stage.end_time - stage.start_time == 2 * MS


def test_a_kept_trace_is_built_when_later_calls_back_not_before():
    tracing, exporter = _tracing()
    callbacks = []

    def later(fn, *args):  # as loop.call_soon: keeps the call for later
        callbacks.append((fn, args))

    slow = _request(tracing, took_ns=TOOK_SLOW_NS)
    fast = _request(tracing)
    assert tracing.end_request(slow, OK, later=later) == "slow"
    assert tracing.end_request(fast, OK, later=later) == "dropped"
    assert exporter.get_finished_spans() == ()  # decided, counted, nothing built yet
    assert tracing.decisions() == {"slow": 1, "dropped": 1}
    assert len(callbacks) == 1  # a dropped trace leaves nothing to do
    fn, args = callbacks[0]
    fn(*args)
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_id == slow.trace_id
    assert span.attributes[SAMPLED_REASON_ATTRIBUTE] == "slow"


def test_a_trace_started_at_its_requests_arrival_is_slow_by_the_time_since():
    """A stream message read a while before it is traced (scored with the others of its turn):
    the trace starts when it arrived, so the slow rule sees what its request metric sees."""
    tracing, exporter = _tracing()
    arrived_ns = time.monotonic_ns() - TOOK_SLOW_NS
    trace = tracing.start_request("svc/Method", {"rpc.method": "Method"}, (), arrived_ns)
    assert tracing.end_request(trace, OK) == "slow"
    (root,) = exporter.get_finished_spans()
    assert root.end_time - root.start_time >= TOOK_SLOW_NS
