"""In-process tail sampling: buffer each trace's spans, decide when its local root ends.

The tracer samples everything (ALWAYS_ON); this processor holds the ended spans of every open
local trace and, when the local root span ends, keeps the whole tree or drops it:

    error   any span of the tree ended with status ERROR
    slow    the root lasted at least the slow threshold
    parent  the caller's traceparent was marked sampled
    ratio   the trace id falls in the configured share (same rule as TraceIdRatioBased)
    linked  (batch traces only) a request trace linked from the batch span was kept

A local root is a span without a parent or with a remote one. A local root that carries links
(the batcher's span per executed batch) is not ratio-sampled: it waits, in a bounded buffer,
for the request traces it links to and is exported as soon as one of them is kept, dropped
once all of them are dropped. Everything is bounded; what does not fit is counted and dropped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import StatusCode
from opentelemetry.util.types import AttributeValue

SAMPLED_REASON_ATTRIBUTE = "riskserve.sampled_reason"
DROPPED_SPANS_ATTRIBUTE = "riskserve.dropped_spans"

REASON_ERROR = "error"
REASON_SLOW = "slow"
REASON_PARENT = "parent"
REASON_RATIO = "ratio"
REASON_LINKED = "linked"
DECISION_DROPPED = "dropped"

_TRACE_ID_LOW_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class TailSamplingPolicy:
    """When to keep a trace and how much may be held while deciding."""

    slow_threshold_ns: int
    sample_ratio: float
    max_open_traces: int = 4096
    max_spans_per_trace: int = 64
    max_pending_batch_traces: int = 1024
    # Decisions remembered for spans ending after their root and for batch links.
    max_remembered_decisions: int = 8192

    @property
    def ratio_bound(self) -> int:
        return round(self.sample_ratio * (1 << 64))


@dataclass(frozen=True)
class TailSamplingStats:
    """Counters since start; `open_traces` and `pending_batch_traces` are current sizes."""

    kept_by_reason: dict[str, int]
    dropped_traces: int
    open_traces: int
    pending_batch_traces: int
    overflow_traces: int
    overflow_spans: int
    evicted_batch_traces: int


@dataclass
class _OpenTrace:
    spans: list[ReadableSpan] = field(default_factory=list)
    has_error: bool = False
    dropped_spans: int = 0


@dataclass
class _PendingBatch:
    spans: list[ReadableSpan]
    waiting_on: set[int]


DecisionListener = Callable[[str], None]


class TailSamplingProcessor(SpanProcessor):
    """Buffers spans per local trace and forwards kept trees to `downstream`.

    `downstream` is typically a BatchSpanProcessor, so export stays off the hot path.
    `on_decision` is called once per decided trace with a reason or "dropped".
    """

    def __init__(
        self,
        downstream: SpanProcessor,
        policy: TailSamplingPolicy,
        on_decision: DecisionListener | None = None,
    ) -> None:
        self._downstream = downstream
        self._policy = policy
        self._ratio_bound = policy.ratio_bound
        self._on_decision = on_decision
        self._lock = threading.Lock()
        # span id -> local root span id, for every span of an open trace (and late children).
        self._root_of: dict[int, int] = {}
        self._open: dict[int, _OpenTrace] = {}
        self._decided: OrderedDict[int, bool] = OrderedDict()
        self._pending: OrderedDict[int, _PendingBatch] = OrderedDict()
        self._batches_waiting_on: dict[int, list[int]] = {}
        self._kept: dict[str, int] = {}
        self._dropped_traces = 0
        self._overflow_traces = 0
        self._overflow_spans = 0
        self._evicted_batches = 0
        self._max_tracked_spans = policy.max_open_traces * (policy.max_spans_per_trace + 1)

    # -- hot path -------------------------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        span_id = span.context.span_id
        parent = span.parent
        with self._lock:
            if parent is None or parent.is_remote:
                if len(self._open) >= self._policy.max_open_traces:
                    self._overflow_traces += 1
                    return
                self._open[span_id] = _OpenTrace()
                self._root_of[span_id] = span_id
                return
            root_id = self._root_of.get(parent.span_id)
            if root_id is None or len(self._root_of) >= self._max_tracked_spans:
                self._overflow_spans += 1
                return
            self._root_of[span_id] = root_id

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is None:
            return
        span_id = context.span_id
        parent = span.parent
        if parent is None or parent.is_remote:
            self._end_root(span, span_id)
            return
        forward = False
        with self._lock:
            root_id = self._root_of.get(span_id)
            trace = self._open.get(root_id) if root_id is not None else None
            if trace is None:
                # Late child (root already decided) or an untracked one.
                self._root_of.pop(span_id, None)
                forward = root_id is not None and self._decided.get(root_id, False)
            elif len(trace.spans) >= self._policy.max_spans_per_trace:
                trace.dropped_spans += 1
                self._overflow_spans += 1
                self._root_of.pop(span_id, None)
            else:
                trace.spans.append(span)
                if span.status.status_code is StatusCode.ERROR:
                    trace.has_error = True
        if forward:
            self._downstream.on_end(span)

    # -- decision ---------------------------------------------------------------------------

    def _end_root(self, root: ReadableSpan, root_id: int) -> None:
        with self._lock:
            trace = self._open.pop(root_id, None) or _OpenTrace()
            self._root_of.pop(root_id, None)
            for child in trace.spans:
                if child.context is not None:
                    self._root_of.pop(child.context.span_id, None)
            reason = self._reason(root, trace)
            if reason is None:
                reason = self._wait_for_links(root, root_id, trace)
            if reason is None:
                return
            kept = reason != DECISION_DROPPED
            self._remember(root_id, kept)
            released, dropped_batches = self._release_batches(root_id, kept)
            if kept:
                self._kept[reason] = self._kept.get(reason, 0) + 1
            else:
                self._dropped_traces += 1
        self._notify(reason)
        if kept:
            self._forward([*trace.spans, root], reason, trace.dropped_spans)
        for batch_spans in released:
            self._notify(REASON_LINKED)
            self._forward(batch_spans, REASON_LINKED, 0)
        for _ in range(dropped_batches):
            self._notify(DECISION_DROPPED)

    def _reason(self, root: ReadableSpan, trace: _OpenTrace) -> str | None:
        if trace.has_error or root.status.status_code is StatusCode.ERROR:
            return REASON_ERROR
        start_ns, end_ns = root.start_time or 0, root.end_time or 0
        if end_ns - start_ns >= self._policy.slow_threshold_ns:
            return REASON_SLOW
        parent = root.parent
        if parent is not None and parent.is_remote and parent.trace_flags.sampled:
            return REASON_PARENT
        if root.links:
            return None
        assert root.context is not None
        if (root.context.trace_id & _TRACE_ID_LOW_MASK) < self._ratio_bound:
            return REASON_RATIO
        return DECISION_DROPPED

    def _wait_for_links(self, root: ReadableSpan, root_id: int, trace: _OpenTrace) -> str | None:
        """Resolve a batch trace against the request traces it links to (lock held)."""
        waiting_on: set[int] = set()
        for link in root.links:
            linked_root = self._root_of.get(link.context.span_id, link.context.span_id)
            if linked_root in self._open:
                waiting_on.add(linked_root)
            elif self._decided.get(linked_root, False):
                return REASON_LINKED
        if not waiting_on:
            return DECISION_DROPPED
        if len(self._pending) >= self._policy.max_pending_batch_traces:
            self._pending.popitem(last=False)
            self._evicted_batches += 1
            self._dropped_traces += 1
        self._pending[root_id] = _PendingBatch([*trace.spans, root], waiting_on)
        for request_root in waiting_on:
            self._batches_waiting_on.setdefault(request_root, []).append(root_id)
        return None

    def _release_batches(
        self, request_root: int, kept: bool
    ) -> tuple[list[list[ReadableSpan]], int]:
        """Batch traces settled by this request's decision: (to export, number dropped)."""
        released: list[list[ReadableSpan]] = []
        dropped = 0
        for batch_id in self._batches_waiting_on.pop(request_root, ()):
            pending = self._pending.get(batch_id)
            if pending is None:
                continue
            if kept:
                del self._pending[batch_id]
                self._remember(batch_id, True)
                self._kept[REASON_LINKED] = self._kept.get(REASON_LINKED, 0) + 1
                released.append(pending.spans)
                continue
            pending.waiting_on.discard(request_root)
            if not pending.waiting_on:
                del self._pending[batch_id]
                self._remember(batch_id, False)
                self._dropped_traces += 1
                dropped += 1
        return released, dropped

    def _remember(self, root_id: int, kept: bool) -> None:
        self._decided[root_id] = kept
        if len(self._decided) > self._policy.max_remembered_decisions:
            self._decided.popitem(last=False)

    def _notify(self, decision: str) -> None:
        if self._on_decision is not None:
            self._on_decision(decision)

    def _forward(self, spans: Sequence[ReadableSpan], reason: str, dropped_spans: int) -> None:
        """Hand a kept tree downstream; the root (last) carries why it was kept."""
        extra: dict[str, AttributeValue] = {SAMPLED_REASON_ATTRIBUTE: reason}
        if dropped_spans:
            extra[DROPPED_SPANS_ATTRIBUTE] = dropped_spans
        for span in spans[:-1]:
            self._downstream.on_end(span)
        self._downstream.on_end(_with_attributes(spans[-1], extra))

    # -- lifecycle --------------------------------------------------------------------------

    def stats(self) -> TailSamplingStats:
        with self._lock:
            return TailSamplingStats(
                kept_by_reason=dict(self._kept),
                dropped_traces=self._dropped_traces,
                open_traces=len(self._open),
                pending_batch_traces=len(self._pending),
                overflow_traces=self._overflow_traces,
                overflow_spans=self._overflow_spans,
                evicted_batch_traces=self._evicted_batches,
            )

    def shutdown(self) -> None:
        self._downstream.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._downstream.force_flush(timeout_millis)


def _with_attributes(span: ReadableSpan, extra: dict[str, AttributeValue]) -> ReadableSpan:
    """A copy of an ended span with attributes added (ended spans are immutable)."""
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes={**(span.attributes or {}), **extra},
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )
