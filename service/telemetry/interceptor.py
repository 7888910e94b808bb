"""A grpc.aio server interceptor that makes one SERVER span per unary-unary RPC.

The caller's W3C ``traceparent``/``tracestate`` metadata is the parent; the span is current
(contextvars) while the handler runs, so handler code reaches it with
``trace.get_current_span()``. Attributes follow the OpenTelemetry RPC conventions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Traces unary-unary RPCs; other handler kinds pass through untraced."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        service, method = split_method(handler_call_details.method)
        parent = extract_parent(handler_call_details.invocation_metadata)
        behaviour = handler.unary_unary
        tracer = self._tracer

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with tracer.start_as_current_span(
                f"{service}/{method}",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                code = grpc.StatusCode.UNKNOWN
                try:
                    response = await behaviour(request, context)
                    code = _code_of(context, grpc.StatusCode.OK)
                    return response
                except grpc.aio.AbortError:
                    code = _code_of(context, grpc.StatusCode.UNKNOWN)
                    raise
                except asyncio.CancelledError:
                    code = _cancelled_code(context)
                    raise
                except Exception as exc:
                    span.record_exception(exc)
                    raise
                finally:
                    _finish(span, code)

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def split_method(full_method: str) -> tuple[str, str]:
    """'/pkg.Service/Method' -> ('pkg.Service', 'Method')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


def extract_parent(metadata: Any) -> Context:
    """The caller's trace context from invocation metadata (W3C TraceContext)."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            carrier[key.lower()] = value
    return _PROPAGATOR.extract(carrier)


def _code_of(context: grpc.aio.ServicerContext, default: grpc.StatusCode) -> grpc.StatusCode:
    code = context.code()
    if code is None:
        return default
    if isinstance(code, grpc.StatusCode):
        return code
    for candidate in grpc.StatusCode:
        if candidate.value[0] == code:
            return candidate
    return default


def _cancelled_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    remaining_s = context.time_remaining()
    if remaining_s is not None and remaining_s <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def _finish(span: trace.Span, code: grpc.StatusCode) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
