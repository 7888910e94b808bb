"""The error boundary every RPC passes through, and the request deadline."""

from __future__ import annotations

import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from opentelemetry import trace

from service.batcher import Scored
from service.errors import InvalidRequest, ServiceError, status_for
from service.telemetry import Telemetry, current_trace_id

__all__ = [
    "Malformed",
    "deadline_for",
    "generic_handler",
    "note_model",
    "note_scored",
    "rpc_boundary",
]


@dataclass(slots=True)
class _CallLabels:
    """What the request metric of the current call is labelled with."""

    model: str = ""
    version: str = ""
    engine: str = ""


_CALL: contextvars.ContextVar[_CallLabels | None] = contextvars.ContextVar(
    "riskserve_call", default=None
)


def note_model(name: str, version: str = "") -> None:
    """Label the current call with the model it asked for (before the lookup can fail)."""
    call = _CALL.get()
    if call is not None:
        call.model, call.version = name, version


def note_scored(
    telemetry: Telemetry | None, name: str, version: str, scored: Scored, decision: str = ""
) -> None:
    """Label the call and its server span with its model, engine and stage times.

    Queue and engine time are attributes of the server span (the batch span, linked, holds
    the engine run itself): a child span per stage cost the hot path more than it told.
    """
    call = _CALL.get()
    if call is not None:
        call.model, call.version, call.engine = name, version, scored.engine
    if telemetry is None:
        return
    span = trace.get_current_span()
    if not span.is_recording():
        return
    attributes: dict[str, str | int | bool] = {
        "riskserve.model": name,
        "riskserve.version": version,
        "riskserve.engine": scored.engine,
        "riskserve.degraded": scored.degraded,
        "riskserve.batch.size": scored.batch_rows,
    }
    if decision:
        attributes["riskserve.decision"] = decision
    if scored.fallback_reason:
        attributes["riskserve.fallback_reason"] = scored.fallback_reason
    if scored.dispatched_ns:
        attributes["riskserve.queue_us"] = (scored.dispatched_ns - scored.enqueued_ns) // 1000
        attributes["riskserve.engine_us"] = (scored.done_ns - scored.dispatched_ns) // 1000
    span.set_attributes(attributes)


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
        telemetry: Telemetry | None = getattr(self, "telemetry", None)
        started = time.perf_counter()
        call = _CallLabels()
        token = _CALL.set(call)
        status = grpc.StatusCode.OK
        try:
            if isinstance(request, Malformed):
                raise InvalidRequest("request", f"is not a valid {request.type_name} message")
            return await handler(self, request, context)
        except ServiceError as exc:
            status = status_for(exc)
            await context.abort(status, str(exc))
        except (grpc.aio.AbortError, grpc.RpcError):
            status = grpc.StatusCode.UNKNOWN
            raise
        except Exception:
            status = grpc.StatusCode.INTERNAL
            trace_id = current_trace_id() or "none"
            log.exception("unexpected error in %s (trace id %s)", handler.__name__, trace_id)
            await context.abort(status, f"internal error (trace id {trace_id})")
        finally:
            _CALL.reset(token)
            if telemetry is not None and call.model:
                telemetry.metrics.observe_request(
                    call.model,
                    call.version,
                    call.engine,
                    status.name,
                    time.perf_counter() - started,
                )
        raise AssertionError("context.abort returned")  # pragma: no cover

    return wrapper


def deadline_for(context: grpc.aio.ServicerContext, budget_s: float) -> float:
    """Monotonic time by which the request must be scored: its gRPC deadline, else the budget."""
    remaining = context.time_remaining()
    return time.monotonic() + (budget_s if remaining is None else max(remaining, 0.0))
