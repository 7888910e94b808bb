"""Span helpers for the request path and the batcher."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext, format_trace_id
from opentelemetry.util.types import AttributeValue

BATCH_SPAN_NAME = "riskserve.batch"


def current_span_context() -> SpanContext:
    """The current span's context, to hand to the batcher with a queued request."""
    return trace.get_current_span().get_span_context()


def current_trace_id() -> str:
    """The current trace id as 32 hex digits ('' outside a trace), for error messages and logs."""
    context = trace.get_current_span().get_span_context()
    return format_trace_id(context.trace_id) if context.is_valid else ""


def record_stage_span(
    tracer: trace.Tracer,
    name: str,
    start_monotonic_ns: int,
    end_monotonic_ns: int,
    attributes: dict[str, AttributeValue] | None = None,
) -> None:
    """Add an already-finished child span (e.g. queue wait) to the current span.

    Stage timings come from a monotonic clock; spans want Unix time, so both ends are shifted
    by the current offset between the two clocks.
    """
    offset_ns = time.time_ns() - time.monotonic_ns()
    span = tracer.start_span(name, start_time=start_monotonic_ns + offset_ns, attributes=attributes)
    span.end(end_time=end_monotonic_ns + offset_ns)


@contextmanager
def batch_span(
    tracer: trace.Tracer,
    request_contexts: Sequence[SpanContext],
    attributes: dict[str, AttributeValue] | None = None,
) -> Iterator[trace.Span]:
    """One span per executed batch, as the root of its own trace, linked to its requests.

    The tail sampler keeps it when any linked request trace is kept (see tail_sampling).
    """
    links = [Link(context) for context in request_contexts if context.is_valid]
    with tracer.start_as_current_span(
        BATCH_SPAN_NAME, context=Context(), links=links, attributes=attributes
    ) as span:
        yield span
