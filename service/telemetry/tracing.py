"""Request and batch traces recorded cheaply, tail-sampled, and only then made into spans.

The Python SDK makes every span a full object as it starts (ids, attribute checks, processor
calls: 10-30 µs each here), and neither it nor its contrib packages can decide to keep a trace
after it ended. So the request path records plain values instead: a `RequestTrace` per RPC with
its stage timings, and a `BatchTrace` per executed batch that links the requests it served.
When the RPC ends, `Tracing.end_request` decides, by these rules in order:

    error   the RPC ended with a status other than OK
    slow    it lasted at least the slow threshold
    parent  the caller's traceparent was marked sampled
    ratio   its trace id falls in the configured share (the rule of TraceIdRatioBased)

Only a kept trace is turned into SDK `ReadableSpan`s (the server span, its stage spans, and the
batch span the first time one of its requests is kept) and handed to the export processor,
which batches and exports off the event loop. What only a kept trace needs is not built while
the request runs: stage records are plain tuples, a batch holds its requests' ids (not span
contexts) and draws its own ids when exported, and `RequestTrace.defer` leaves the rest (the
scoring stages and attributes) to a function called only on export. A dropped trace costs a
few assignments.
Nothing is buffered between requests: a record lives as long as its RPC (whose number the
batcher's queue bounds), so no open-trace table can grow.
"""

from __future__ import annotations

import contextvars
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    format_trace_id,
    get_current_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

__all__ = [
    "BATCH_SPAN_NAME",
    "SAMPLED_REASON_ATTRIBUTE",
    "BatchTrace",
    "RequestTrace",
    "TailSamplingPolicy",
    "TailSamplingStats",
    "Tracing",
    "current_request_trace",
    "current_trace_id",
]

SAMPLED_REASON_ATTRIBUTE = "riskserve.sampled_reason"
BATCH_SPAN_NAME = "riskserve.batch"

REASON_ERROR = "error"
REASON_SLOW = "slow"
REASON_PARENT = "parent"
REASON_RATIO = "ratio"
REASON_ALL = "all"
DECISION_DROPPED = "dropped"
# The most a stop waits for kept traces to reach their exporters (a collector may be down).
EXPORT_SHUTDOWN_S = 5.0

_log = logging.getLogger(__name__)

_LOW_64_BITS = (1 << 64) - 1  # a trace id's low half (the ratio rule), a span id's width
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_PROPAGATOR = TraceContextTextMapPropagator()
_OK = Status(StatusCode.UNSET)

Attributes = dict[str, AttributeValue]


def _new_id(bits: int) -> int:
    # As the SDK's RandomIdGenerator; zero is the invalid id, so draw again (about never).
    value = random.getrandbits(bits)
    while not value:
        value = random.getrandbits(bits)
    return value


def _new_trace_and_span_ids() -> tuple[int, int]:
    """A new trace id and span id from one draw of 192 bits (one call on every request, not
    two: in a live server at light load the request path runs with cold caches, where each
    call counts)."""
    bits = random.getrandbits(192)
    trace_id, span_id = bits >> 64, bits & _LOW_64_BITS
    if not trace_id or not span_id:
        return _new_id(128), _new_id(64)
    return trace_id, span_id


@dataclass(frozen=True)
class TailSamplingPolicy:
    """When to keep a trace; `export_all` keeps every one (a Collector samples instead)."""

    slow_threshold_ns: int
    sample_ratio: float
    export_all: bool = False

    @property
    def ratio_bound(self) -> int:
        return round(self.sample_ratio * (1 << 64))


@dataclass(frozen=True)
class TailSamplingStats:
    """Decisions since start, and the requests whose trace is open now."""

    kept_by_reason: dict[str, int]
    dropped_traces: int
    open_traces: int


class BatchTrace:
    """One executed batch: a root span of its own trace, linked to the requests it served.

    `links` holds the (trace id, span id) of each request; the batch's own ids are drawn when
    it is first exported, so a trace id of 0 means not exported yet.
    """

    __slots__ = ("attributes", "end_ns", "links", "span_id", "start_ns", "trace_id")

    def __init__(self, links: list[tuple[int, int]], attributes: Attributes) -> None:
        self.trace_id = 0
        self.span_id = 0
        self.links = links
        self.attributes = attributes
        self.start_ns = time.time_ns()
        self.end_ns = 0

    def end(self, attributes: Attributes) -> None:
        self.end_ns = time.time_ns()
        self.attributes.update(attributes)


# A stage span to be: name, wall-clock start and end (ns), attributes.
_Stage = tuple[str, int, int, Attributes | None]
# Called on export only, as details(trace, attributes, *args): adds to the server span's
# attributes (the dict given) and the trace's stages.
Deferred = Callable[..., None]


@dataclass(slots=True)
class RequestTrace:
    """What one RPC's server span and its stage spans will say, if the trace is kept."""

    trace_id: int
    span_id: int
    parent: SpanContext | None
    name: str
    attributes: Attributes
    # Wall-clock start, and wall minus monotonic, so monotonic stage times convert exactly.
    start_ns: int = field(default_factory=time.time_ns)
    offset_ns: int = 0
    stages: list[_Stage] = field(default_factory=list)
    batch: BatchTrace | None = None
    deferred: tuple[Deferred, tuple[Any, ...]] | None = None

    @property
    def context(self) -> SpanContext:
        return SpanContext(self.trace_id, self.span_id, is_remote=False, trace_flags=_SAMPLED)

    def add_stage(
        self,
        name: str,
        start_monotonic_ns: int,
        end_monotonic_ns: int,
        attributes: Attributes | None = None,
    ) -> None:
        """A child span from monotonic timestamps (e.g. the queue wait), made only if kept."""
        offset = self.offset_ns
        self.stages.append(
            (name, start_monotonic_ns + offset, end_monotonic_ns + offset, attributes)
        )

    def defer(self, details: Deferred, *args: Any) -> None:
        """Leave `details(self, attributes, *args)` to export time (replacing any earlier one):
        it may add stages and write the server span's `attributes`; a dropped trace never
        calls it, so it costs the request path one assignment."""
        self.deferred = (details, args)


_CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "riskserve_request_trace", default=None
)


def current_request_trace() -> RequestTrace | None:
    """The trace of the RPC being handled (None outside one, or with tracing off)."""
    return _CURRENT.get()


def current_trace_id() -> str:
    """The current trace id as 32 hex digits ('' outside a trace), for errors and logs."""
    trace = _CURRENT.get()
    return format_trace_id(trace.trace_id) if trace is not None else ""


def _parent_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> SpanContext | None:
    """The caller's span from W3C `traceparent`/`tracestate` metadata, if it sent one."""
    carrier: dict[str, str] | None = None
    for key, value in metadata or ():
        if (key == "traceparent" or key == "tracestate") and isinstance(value, str):
            carrier = carrier or {}
            carrier[key] = value
    if carrier is None:
        return None
    context = get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return context if context.is_valid else None


class Tracing:
    """Starts request and batch traces, decides at each request's end, exports what is kept."""

    def __init__(
        self,
        policy: TailSamplingPolicy,
        export: SpanProcessor,
        resource: Resource,
        scope: InstrumentationScope,
        keeps: bool = True,
    ) -> None:
        """`keeps`: False where the spans go nowhere (no exporter): every trace is then
        dropped, so that no exemplar names a trace that was never exported."""
        self._keeps = keeps
        self._policy = policy
        self._slow_ns = policy.slow_threshold_ns
        self._ratio_bound = policy.ratio_bound
        self._export = export
        self._resource = resource
        self._scope = scope
        self._kept: dict[str, int] = {}
        self._dropped = 0
        self._open = 0

    # -- the request path (event loop thread) ----------------------------------------------

    def start_request(
        self,
        name: str,
        attributes: Attributes,
        metadata: Iterable[tuple[str, str | bytes]] | None = None,
        arrived_ns: int | None = None,
    ) -> RequestTrace:
        """A request's trace, started now, or at `arrived_ns` (monotonic) where the request
        was read before (a stream message scored with others of its turn): its duration, as
        the slow rule sees it, is then the one its request metric records."""
        parent = _parent_from(metadata)
        if parent is None:
            trace_id, span_id = _new_trace_and_span_ids()
        else:
            trace_id, span_id = parent.trace_id, _new_id(64)
        start_ns = time.time_ns()
        offset_ns = start_ns - time.monotonic_ns()
        if arrived_ns is not None:
            start_ns = arrived_ns + offset_ns
        self._open += 1
        return RequestTrace(trace_id, span_id, parent, name, attributes, start_ns, offset_ns)

    def activate(self, trace: RequestTrace) -> contextvars.Token[RequestTrace | None]:
        return _CURRENT.set(trace)

    def deactivate(self, token: contextvars.Token[RequestTrace | None]) -> None:
        _CURRENT.reset(token)

    def start_batch(
        self, requests: Sequence[RequestTrace | None], attributes: Attributes
    ) -> BatchTrace:
        return BatchTrace([(r.trace_id, r.span_id) for r in requests if r is not None], attributes)

    def end_request(
        self,
        trace: RequestTrace,
        status_code: int,
        description: str = "",
        later: Callable[..., object] | None = None,
    ) -> str:
        """Decide and, if kept, export; returns the reason or 'dropped'.

        `status_code` is the gRPC status as a number (0 is OK). With `later` (an event loop's
        `call_soon`), a kept trace's spans are built when it calls back, not now: the RPC's
        reply goes out first. Traces kept for being slow are the tail itself, and building
        their spans (tens of microseconds) inside the RPC would add to exactly those requests.
        """
        end_ns = time.time_ns()
        self._open -= 1
        reason = self._reason(trace, status_code, end_ns) if self._keeps else DECISION_DROPPED
        if reason == DECISION_DROPPED:
            self._dropped += 1
            return reason
        self._kept[reason] = self._kept.get(reason, 0) + 1
        if later is None:
            self._emit(trace, status_code, description, end_ns, reason)
        else:
            later(self._emit, trace, status_code, description, end_ns, reason)
        return reason

    def _reason(self, trace: RequestTrace, status_code: int, end_ns: int) -> str:
        if self._policy.export_all:
            return REASON_ALL
        if status_code != 0:
            return REASON_ERROR
        if end_ns - trace.start_ns >= self._slow_ns:
            return REASON_SLOW
        parent = trace.parent
        if parent is not None and parent.trace_flags.sampled:
            return REASON_PARENT
        if (trace.trace_id & _LOW_64_BITS) < self._ratio_bound:
            return REASON_RATIO
        return DECISION_DROPPED

    # -- export (kept traces only) ---------------------------------------------------------

    def _emit(
        self, trace: RequestTrace, status_code: int, description: str, end_ns: int, reason: str
    ) -> None:
        context = trace.context
        attributes = dict(trace.attributes)
        if trace.deferred is not None:
            details, args = trace.deferred
            details(trace, attributes, *args)
        attributes["rpc.grpc.status_code"] = status_code
        if reason != REASON_ALL:
            attributes[SAMPLED_REASON_ATTRIBUTE] = reason
        status = Status(StatusCode.ERROR, description) if status_code != 0 else _OK
        for name, start_ns, stage_end_ns, stage_attributes in trace.stages:
            self._span(
                name,
                SpanContext(trace.trace_id, _new_id(64), False, _SAMPLED),
                context,
                SpanKind.INTERNAL,
                stage_attributes or {},
                start_ns,
                stage_end_ns,
            )
        self._span(
            trace.name,
            context,
            trace.parent,
            SpanKind.SERVER,
            attributes,
            trace.start_ns,
            end_ns,
            status=status,
        )
        batch = trace.batch
        if batch is not None and not batch.trace_id and batch.end_ns:
            batch.trace_id, batch.span_id = _new_id(128), _new_id(64)
            self._span(
                BATCH_SPAN_NAME,
                SpanContext(batch.trace_id, batch.span_id, False, _SAMPLED),
                None,
                SpanKind.INTERNAL,
                batch.attributes,
                batch.start_ns,
                batch.end_ns,
                links=[
                    Link(SpanContext(trace_id, span_id, False, _SAMPLED))
                    for trace_id, span_id in batch.links
                ],
            )

    def _span(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: Attributes,
        start_ns: int,
        end_ns: int,
        *,
        status: Status = _OK,
        links: Sequence[Link] = (),
    ) -> None:
        self._export.on_end(
            ReadableSpan(
                name=name,
                context=context,
                parent=parent,
                resource=self._resource,
                attributes=attributes,
                links=links,
                kind=kind,
                status=status,
                start_time=start_ns,
                end_time=end_ns,
                instrumentation_scope=self._scope,
            )
        )

    # -- lifecycle -------------------------------------------------------------------------

    def stats(self) -> TailSamplingStats:
        return TailSamplingStats(dict(self._kept), self._dropped, self._open)

    def decisions(self) -> dict[str, int]:
        """Traces decided so far by outcome: each keep reason, and 'dropped'."""
        return {**self._kept, DECISION_DROPPED: self._dropped}

    def shutdown(self, timeout_s: float = EXPORT_SHUTDOWN_S) -> bool:
        """Export what is buffered and stop, waiting `timeout_s` at most; whether it finished.

        The SDK's batch processor waits up to 30 s for an exporter that gets no answer (a
        collector down), longer than a pod's grace leaves. Its threads are daemons: one still
        exporting when this returns does not hold the process's exit.
        """
        done = threading.Thread(target=self._export.shutdown, name="trace-export-stop", daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            _log.warning(
                "trace export did not finish within %.1f s; its spans are dropped", timeout_s
            )
            return False
        return True
