"""The boundary every RPC passes through: its trace, its error status, its request metric."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from service.api.admission import SCORING_METHODS, Admission, refuse
from service.api.registration import Malformed
from service.batching.batcher import Scored
from service.errors import DeadlineMissed, InvalidRequest, Overloaded, ServiceError, status_for
from service.telemetry import RequestTrace, Telemetry, current_request_trace, current_trace_id
from service.telemetry.tracing import DECISION_DROPPED, Attributes, Tracing

__all__ = [
    "after_reply",
    "count_refused_message",
    "note_model",
    "note_scored",
    "note_validated",
    "rpc_boundary",
    "start_rpc_trace",
    "trace_scored",
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
    """Note the model the current call asked for (before the lookup can fail); unless the
    call is scored, its metric labels are checked against what is loaded (`_labels`)."""
    call = _CALL.get()
    if call is not None:
        call.model, call.version = name, version


def note_scored(
    telemetry: Telemetry | None, name: str, version: str, scored: Scored, decision: str = ""
) -> None:
    """Label the call with its model and engine, and its trace with what the batch did.

    The queue wait and the engine run become stage spans of the request's trace, and the
    batch (a span of its own, linked) is attached; none of it is built unless the trace is kept.
    """
    call = _CALL.get()
    if call is not None:
        call.model, call.version, call.engine = name, version, scored.engine
    trace = current_request_trace()
    if trace is not None:
        trace_scored(trace, name, version, scored, decision)


def trace_scored(
    trace: RequestTrace, name: str, version: str, scored: Scored, decision: str = ""
) -> None:
    """Attach the batch to `trace` and leave its scoring details to export time."""
    trace.batch = scored.batch_trace
    trace.defer(_scored_details, name, version, scored, decision)


def _scored_details(
    trace: RequestTrace,
    attributes: dict[str, Any],
    name: str,
    version: str,
    scored: Scored,
    decision: str,
) -> None:
    """A kept trace's scoring attributes and its queue and score stages (export time only)."""
    attributes["riskserve.model"] = name
    attributes["riskserve.version"] = version
    attributes["riskserve.engine"] = scored.engine
    attributes["riskserve.degraded"] = scored.degraded
    attributes["riskserve.batch.size"] = scored.batch_rows
    if decision:
        attributes["riskserve.decision"] = decision
    if scored.fallback_reason:
        attributes["riskserve.fallback_reason"] = scored.fallback_reason
    if scored.dispatched_ns:
        attributes["riskserve.queue_us"] = (scored.dispatched_ns - scored.enqueued_ns) // 1000
        attributes["riskserve.engine_us"] = (scored.done_ns - scored.dispatched_ns) // 1000
        trace.add_stage("riskserve.queue", scored.enqueued_ns, scored.dispatched_ns)
        trace.add_stage(
            "riskserve.score",
            scored.dispatched_ns,
            scored.done_ns,
            {"riskserve.engine": scored.engine, "riskserve.batch.size": scored.batch_rows},
        )


def note_validated(started_monotonic_ns: int) -> None:
    """The request was decoded and checked, from `started_monotonic_ns` until now."""
    trace = current_request_trace()
    if trace is not None:
        trace.add_stage("riskserve.validate", started_monotonic_ns, time.monotonic_ns())


log = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


# The stream methods, whose every message is a scoring request of its own.
STREAM_METHODS = frozenset({"ScoreStream", "ModelStreamInfer"})


def _check_not_expired(telemetry: Telemetry | None, context: grpc.aio.ServicerContext) -> None:
    """Refuse a call whose caller's deadline passed while it waited to be read: its caller has
    gone, and scoring it would only take the engine from calls that can still make theirs."""
    remaining_s = context.time_remaining()
    if remaining_s is not None and remaining_s <= 0:
        if telemetry is not None:
            telemetry.metrics.count_shed("", "deadline")
        raise DeadlineMissed("the deadline passed before the service reached the request")


def rpc_boundary(handler: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """The one wrapper of every RPC: its trace, its error mapping, its request metric.

    Service errors become their status; anything unexpected becomes INTERNAL with the trace
    id, logged once. The servicer names its gRPC service in `SERVICE_NAME` (for the span name)
    and holds `telemetry` (None: neither traced nor measured).
    """
    method = handler.__name__
    bounded = method in SCORING_METHODS
    # A scoring call is counted though it was refused before its model was read (malformed,
    # no model named, its deadline gone), under the model label `unknown`.
    counted = bounded or method in STREAM_METHODS

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        telemetry: Telemetry | None = getattr(self, "telemetry", None)
        admission: Admission | None = getattr(self, "admission", None) if bounded else None
        # Refused inside the trace and the count, as any other failed call: its error trace
        # is kept and it is in riskserve_requests_total, where it was only in the shed count.
        full = admission if admission is not None and admission.active >= admission.limit else None
        if full is not None:
            admission = None  # not held: nothing to give back
        tracing = telemetry.tracing if telemetry is not None else None
        started = time.perf_counter()
        call = _CallLabels()
        call_token = _CALL.set(call)
        trace = trace_token = None
        if tracing is not None:
            trace = start_rpc_trace(
                tracing, self.SERVICE_NAME, method, context.invocation_metadata()
            )
            trace_token = tracing.activate(trace)
        status = _OK
        if admission is not None:
            admission.active += 1
        try:
            if full is not None:
                raise Overloaded(refuse(telemetry, full))
            if isinstance(request, Malformed):
                raise InvalidRequest("request", f"is not a valid {request.type_name} message")
            if bounded:
                _check_not_expired(telemetry, context)
            return await handler(self, request, context)
        except ServiceError as exc:
            status = status_for(exc)
            await context.abort(status, str(exc))
        except grpc.aio.AbortError:
            status = _code_of(context)
            raise
        except asyncio.CancelledError:
            status = _cancelled_code(context)
            raise
        except Exception:
            status = grpc.StatusCode.INTERNAL
            trace_id = current_trace_id() or "none"
            log.exception("unexpected error in %s (trace id %s)", method, trace_id)
            await context.abort(status, f"internal error (trace id {trace_id})")
        finally:
            if admission is not None:
                admission.active -= 1
            _CALL.reset(call_token)
            # An enum's .value and .name are Python-level properties: OK skips both, and
            # neither is read twice.
            code, name = (0, "OK") if status is _OK else (status.value[0], status.name)
            kept_trace = None
            if tracing is not None and trace is not None and trace_token is not None:
                tracing.deactivate(trace_token)
                details = "" if code == 0 else name
                if tracing.end_request(trace, code, details, after_reply) != DECISION_DROPPED:
                    kept_trace = trace.context
            if telemetry is not None and (call.model or counted):
                model, version = _labels(telemetry, call)
                telemetry.metrics.observe_request(
                    model,
                    version,
                    call.engine,
                    name,
                    time.perf_counter() - started,
                    kept_trace,
                    method,
                )
        raise AssertionError("context.abort returned")  # pragma: no cover

    return wrapper


def _labels(telemetry: Telemetry, call: _CallLabels) -> tuple[str, str]:
    """A scored call's model and version label it as they are; any other call's only where
    they name a loaded version (a caller must not create metric series at will)."""
    if call.engine:
        return call.model, call.version
    return telemetry.metrics.loaded_labels(call.model, call.version)


def start_rpc_trace(
    tracing: Tracing,
    service: str,
    method: str,
    metadata: Any,
    arrived_ns: int | None = None,
) -> RequestTrace:
    """The trace of one call of `service`/`method` (or one message of a stream method), from
    `arrived_ns` where given."""
    attributes: Attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
    return tracing.start_request(f"{service}/{method}", attributes, metadata, arrived_ns)


def count_refused_message(
    telemetry: Telemetry,
    service: str,
    method: str,
    metadata: Any,
    received_ns: int,
    code: grpc.StatusCode,
    model: tuple[str, str] = ("", ""),
) -> None:
    """A stream message answered `code` without reaching the RPC boundary: traced (its error
    trace kept, as the boundary keeps a failed call's) and counted in riskserve_requests_total
    under `model` (name, version) where it is loaded, else `unknown`."""
    kept = None
    tracing = telemetry.tracing
    if tracing is not None:
        trace = start_rpc_trace(tracing, service, method, metadata, received_ns)
        if tracing.end_request(trace, code.value[0], code.name, after_reply) != DECISION_DROPPED:
            kept = trace.context
    name, version = telemetry.metrics.loaded_labels(*model)
    duration_s = (time.monotonic_ns() - received_ns) / 1e9
    telemetry.metrics.observe_request(name, version, "", code.name, duration_s, kept, method)


def after_reply(callback: Callable[..., object], *args: Any) -> None:
    """Run `callback(*args)` on the event loop's next turn: after this RPC's task yields, when
    gRPC has started sending the reply (a kept trace's spans are built there)."""
    asyncio.get_running_loop().call_soon(callback, *args)


def _code_of(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status an abort set (grpc.aio reports it as a StatusCode or as its number)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    for candidate in grpc.StatusCode:
        if candidate.value[0] == code:
            return candidate
    return grpc.StatusCode.UNKNOWN


def _cancelled_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    remaining_s = context.time_remaining()
    if remaining_s is not None and remaining_s <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED
