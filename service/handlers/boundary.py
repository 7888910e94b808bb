"""The error boundary every RPC passes through, and the request deadline."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from opentelemetry import trace

from service.errors import InvalidRequest, ServiceError, status_for

__all__ = ["Malformed", "deadline_for", "generic_handler", "rpc_boundary"]

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


class Malformed:
    """Stands in for a request whose bytes did not parse, so the handler can say so."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def _lenient(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except (DecodeError, ValueError, RuntimeError):
            return Malformed(message_class.DESCRIPTOR.full_name)

    return parse


def generic_handler(servicer: Any, service: ServiceDescriptor) -> grpc.GenericRpcHandler:
    """Method handlers for a servicer whose undecodable requests become INVALID_ARGUMENT.

    gRPC's generated registration answers a request that fails to parse with a bare INTERNAL;
    a caller sending bad bytes deserves to be told its request is malformed.
    """
    handlers = {
        method.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=_lenient(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
        for method in service.methods
    }
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def rpc_boundary(handler: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Map service errors to their status; anything unexpected to INTERNAL, logged once."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            if isinstance(request, Malformed):
                raise InvalidRequest("request", f"is not a valid {request.type_name} message")
            return await handler(self, request, context)
        except ServiceError as exc:
            await context.abort(status_for(exc), str(exc))
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception:
            span_context = trace.get_current_span().get_span_context()
            trace_id = f"{span_context.trace_id:032x}" if span_context.is_valid else "none"
            log.exception("unexpected error in %s (trace id %s)", handler.__name__, trace_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (trace id {trace_id})")
        raise AssertionError("context.abort returned")  # pragma: no cover

    return wrapper


def deadline_for(context: grpc.aio.ServicerContext, budget_s: float) -> float:
    """Monotonic time by which the request must be scored: its gRPC deadline, else the budget."""
    remaining = context.time_remaining()
    return time.monotonic() + (budget_s if remaining is None else max(remaining, 0.0))
