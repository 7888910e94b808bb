"""The error boundary every RPC passes through, and the request deadline."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from opentelemetry import trace

from service.errors import ServiceError, status_for

__all__ = ["deadline_for", "rpc_boundary"]

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def rpc_boundary(handler: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Map service errors to their status; anything unexpected to INTERNAL, logged once."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
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
