"""Bidirectional streams: many requests on one call, each answered on its own.

A stream reads its messages in one task and starts each on the same per-request path as the
unary RPC, wrapped in the same RPC boundary (its own trace, request metric and error mapping),
with a `MessageContext` standing in for the call's context. Responses are written as they
complete. A message that fails is answered with its status and the stream stays open.

A method with a `per_batch` handler (ModelStreamInfer) instead has the messages that all its
streams read in one turn of the event loop handed over together at the turn's end
(`MessageStreams.arrive`), so that they are decoded, checked and queued as arrays, one job per
model version, with no coroutine, context or boundary per message; the handler still answers,
traces and counts each message, and hands back to the per-message path any it does not take.

Per stream at most `max_in_flight` messages are scored at once; a message beyond that is
answered RESOURCE_EXHAUSTED at once. Answers waiting to be written count too: at twice the
bound the stream stops reading, so a caller that does not read its answers only fills gRPC's
flow-control window, never the server's memory. On drain (SIGTERM) a stream stops reading,
answers every message it has read, and ends with UNAVAILABLE: the caller resends elsewhere
whatever it sent that was never answered.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import grpc

from service.api.boundary import count_refused_message, rpc_boundary
from service.api.registration import Malformed
from service.batching.batcher import ARRIVES_ALONE
from service.batching.budget import Budget

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "Arrival",
    "MessageContext",
    "MessageStreams",
    "StreamMethod",
    "stream_method",
]

# Messages one stream may have in flight when not configured (Settings.max_stream_in_flight).
DEFAULT_MAX_IN_FLIGHT = 256

Req = TypeVar("Req")
Resp = TypeVar("Resp")

log = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_DRAINING = "server is shutting down; messages not answered were not accepted, resend them"


class MessageContext:
    """What the RPC boundary and the handlers read of a call's context, for one message.

    `time_remaining()` is the message's own deadline (None where there is none, as grpc.aio
    says of a call without one); `abort()` records the status and raises like grpc.aio's, so
    the boundary maps errors exactly as for a unary call.
    """

    __slots__ = ("_code", "_details", "_metadata", "deadline")

    def __init__(self, metadata: Any, deadline: float | None) -> None:
        self._metadata = metadata
        self.deadline = deadline  # monotonic seconds
        self._code = grpc.StatusCode.OK
        self._details = ""

    def invocation_metadata(self) -> Any:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details
        raise grpc.aio.AbortError()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


# The per-message handler: a boundary-wrapped (servicer, request, MessageContext) coroutine.
PerMessage = Callable[[Any, Req, MessageContext], Coroutine[Any, Any, Resp]]
# The answer to a message that failed: (request, code, details) -> response.
ErrorReply = Callable[[Req | Malformed, grpc.StatusCode, str], Resp]
# A message's own time budget in seconds, or None for the server's.
MessageBudget = Callable[[Req], float | None]


class Arrival(Generic[Req, Resp]):
    """A message read from a stream, waiting for the end of the loop's turn to be scored with
    the others read in the same turn (`StreamMethod.per_batch`).

    `deadline` is the batcher's, as `Budget.deadline` makes it for every path (the margin
    kept back). `timing` is what set it: the message's own budget (None: the server's) and
    its call's deadline. Messages of one turn alike in it have deadlines apart by no more than
    their reads, so they may be scored by the earliest; others would be shed by a deadline not
    theirs.
    """

    __slots__ = ("deadline", "done", "received_ns", "request", "stream", "timing")

    def __init__(
        self,
        stream: _Stream[Req, Resp],
        request: Req,
        deadline: float,
        received_ns: int,
        timing: tuple[float | None, float],
    ) -> None:
        self.stream = stream
        self.request = request
        self.deadline = deadline  # monotonic seconds
        self.received_ns = received_ns  # monotonic nanoseconds
        self.timing = timing
        self.done = False  # answered, or handed to the per-message path

    @property
    def metadata(self) -> Any:
        """Its call's invocation metadata (a trace parent, say)."""
        return self.stream._metadata

    def answer(self, reply: Resp) -> None:
        """Its answer: written to its stream in completion order."""
        if not self.done:
            self.done = True
            self.stream._answer_arrival(reply)

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        """Answer it with a failed status, as the stream method answers a failed message."""
        self.answer(self.stream._error_reply(self.request, code, details))

    def alone(self) -> None:
        """Score it on its own, on the per-message path (what the batch path does not take)."""
        if not self.done:
            self.done = True
            self.stream._start_arrival(self.request)


# The messages of one turn of the event loop, answered together: (servicer, arrivals) -> None;
# it must answer each arrival, or hand it to the per-message path, exactly once.
PerBatch = Callable[[Any, list[Arrival[Any, Any]]], None]


@dataclass(frozen=True, slots=True)
class StreamMethod(Generic[Req, Resp]):
    """How a stream RPC answers each message: scored, failed, and its own time budget; with
    `per_batch`, the messages read in one turn of the loop are scored together."""

    per_message: PerMessage[Req, Resp]
    error_reply: ErrorReply[Req, Resp]
    message_budget: MessageBudget[Req]
    per_batch: PerBatch | None = None


def stream_method(
    name: str,
    handler: PerMessage[Req, Resp],
    error_reply: ErrorReply[Req, Resp],
    message_budget: MessageBudget[Req],
    per_batch: PerBatch | None = None,
) -> StreamMethod[Req, Resp]:
    """The stream RPC `name`: `handler` per message behind the RPC boundary, traced and
    measured as `name`; `per_batch`, where given, takes the messages it can score together."""
    handler.__name__ = name
    # The boundary's wrapper is a coroutine function, so a stream can make it a task.
    wrapped = cast(PerMessage[Req, Resp], rpc_boundary(handler))
    return StreamMethod(wrapped, error_reply, message_budget, per_batch)


class MessageStreams:
    """The open streams of a server: their in-flight bound, and their drain on stop."""

    def __init__(self, max_in_flight: int, budget: Budget) -> None:
        self.max_in_flight = max_in_flight
        self.budget = budget
        self.draining = False
        self._open: set[_Stream[Any, Any]] = set()
        # Messages read this turn of the loop for a `per_batch` method, and whether the call
        # that hands them over is scheduled.
        self._arrivals: list[Arrival[Any, Any]] = []
        self._flush_scheduled = False

    def arrive(self, arrival: Arrival[Any, Any]) -> None:
        """Queue a message read this turn; all of them go to their `per_batch` at its end."""
        self._arrivals.append(arrival)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        arrivals, self._arrivals = self._arrivals, []
        groups: dict[tuple[int, int], list[Arrival[Any, Any]]] = {}
        for arrival in arrivals:
            stream = arrival.stream
            groups.setdefault((id(stream._servicer), id(stream._method)), []).append(arrival)
        for group in groups.values():
            stream = group[0].stream
            per_batch = stream._method.per_batch
            assert per_batch is not None
            try:
                per_batch(stream._servicer, group)
            except Exception:
                log.exception("scoring %d stream messages together failed", len(group))
                for arrival in group:
                    arrival.fail(grpc.StatusCode.INTERNAL, "internal error")

    def drain(self) -> None:
        """Stop reading every stream; each ends once its read messages are answered."""
        self.draining = True
        for stream in tuple(self._open):
            stream.drain()

    @property
    def open_streams(self) -> int:
        return len(self._open)

    async def serve(
        self,
        requests: AsyncIterator[Req],
        context: grpc.aio.ServicerContext,
        servicer: Any,
        method: StreamMethod[Req, Resp],
    ) -> None:
        """Answer one stream's messages, writing each response as it completes."""
        if self.draining:
            context.set_code(_UNAVAILABLE)
            context.set_details(_DRAINING)
            return
        stream = _Stream(self, requests, context, servicer, method)
        self._open.add(stream)
        try:
            await stream.run()
        finally:
            self._open.discard(stream)
            stream.close()


class _Message(Generic[Req, Resp]):
    """One message being scored: its coroutine stepped here rather than by an asyncio Task.

    A Task per message costs an object and an event-loop turn before it starts. Here the
    first step runs at once, in the reader; each later step is the done callback of the future
    the coroutine awaits, in the message's own context, which is all a Task would do for a
    coroutine that awaits only futures, as the per-request path does. So that path must not
    need `asyncio.current_task()` (`asyncio.timeout` does): it has none here.
    """

    __slots__ = ("_context_vars", "_coro", "_stream", "_waiting", "context", "request")

    def __init__(
        self,
        stream: _Stream[Req, Resp],
        coro: Coroutine[Any, Any, Resp],
        request: Req,
        context: MessageContext,
    ) -> None:
        self._stream = stream
        self._coro = coro
        self.request = request
        self.context = context
        self._context_vars = contextvars.copy_context()
        self._waiting: asyncio.Future[Any] | None = None

    def start(self) -> None:
        self._context_vars.run(self._step)

    def cancel(self) -> None:
        """Cancel what the message awaits; it ends with CancelledError, as a Task would."""
        if self._waiting is not None:
            self._waiting.cancel()

    def _step(self, _done: object = None) -> None:
        self._waiting = None
        try:
            awaited = self._coro.send(None)
        except StopIteration as finished:
            self._stream._finished(self, finished.value, None)
            return
        except (Exception, asyncio.CancelledError) as exc:
            self._stream._finished(self, None, exc)
            return
        if getattr(awaited, "_asyncio_future_blocking", None):
            awaited._asyncio_future_blocking = False
            self._waiting = awaited
            awaited.add_done_callback(self._step, context=self._context_vars)
        elif awaited is None:  # a bare yield (asyncio.sleep(0)): run again on the next turn
            asyncio.get_running_loop().call_soon(self._step, context=self._context_vars)
        else:
            self._coro.close()
            failure = RuntimeError(f"a stream message awaited {awaited!r}, not a future")
            self._stream._finished(self, None, failure)


class _Stream(Generic[Req, Resp]):
    """One call's reader, its messages in flight, and its answers not yet written."""

    def __init__(
        self,
        streams: MessageStreams,
        requests: AsyncIterator[Req],
        context: grpc.aio.ServicerContext,
        servicer: Any,
        method: StreamMethod[Req, Resp],
    ) -> None:
        self._streams = streams
        self._requests = requests
        self._context = context
        self._metadata = context.invocation_metadata()
        remaining = context.time_remaining()
        self._call_deadline = float("inf") if remaining is None else time.monotonic() + remaining
        self._servicer = servicer
        self._method = method
        self._per_message = method.per_message
        self._error_reply = method.error_reply
        self._message_budget = method.message_budget
        self._loop = asyncio.get_running_loop()
        self._answers: deque[Resp] = deque()
        self._scoring: set[_Message[Req, Resp]] = set()
        self._unwritten = 0  # read and not yet written: in flight plus answers queued
        self._batched = 0  # read and handed to `per_batch`, not yet answered
        self._reading = True
        self._draining = False
        self._writer_waiting: asyncio.Future[None] | None = None
        self._reader_waiting: asyncio.Future[None] | None = None
        self._reader: asyncio.Task[None] | None = None

    def drain(self) -> None:
        self._draining = True
        if self._reader is not None and self._reading:
            self._reader.cancel()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for message in tuple(self._scoring):
            message.cancel()

    async def run(self) -> None:
        # Headers at once: a client may wait for them before sending, so that a call refused
        # before this handler (UNAUTHENTICATED, say) never races its first write.
        await self._context.send_initial_metadata(())
        if self._draining:
            self._reading = False
        else:
            self._reader = self._loop.create_task(self._read())
            # Not a `finally` in `_read`: a task cancelled before its first step runs none of it.
            self._reader.add_done_callback(self._read_ended)
        answers = self._answers
        write = self._context.write
        while True:
            while answers:
                await write(answers.popleft())
                self._unwritten -= 1
                waiting = self._reader_waiting
                if waiting is not None and not waiting.done():
                    waiting.set_result(None)
            if not self._reading and not self._scoring and not self._batched:
                break
            self._writer_waiting = self._loop.create_future()
            await self._writer_waiting
            self._writer_waiting = None
        if self._draining:
            self._context.set_code(_UNAVAILABLE)
            self._context.set_details(_DRAINING)

    async def _read(self) -> None:
        # Messages read here start in copies of this task's context: none waits for company.
        ARRIVES_ALONE.set(False)
        limit = self._streams.max_in_flight
        per_batch, arrive = self._method.per_batch, self._streams.arrive
        try:
            async for request in self._requests:
                self._unwritten += 1
                if len(self._scoring) + self._batched >= limit:
                    self._refuse(request, limit)
                elif per_batch is not None and not isinstance(request, Malformed):
                    self._batched += 1
                    arrive(self._arrival(request))
                else:
                    self._start(request)
                if self._unwritten >= 2 * limit:
                    # Answers are not being read: stop reading until they are.
                    self._reader_waiting = self._loop.create_future()
                    await self._reader_waiting
                    self._reader_waiting = None
        except asyncio.CancelledError:
            if not self._draining:
                raise
        except Exception:
            # The call broke while reading; what was read is still answered if it can be.
            log.debug("reading a stream failed", exc_info=True)

    def _read_ended(self, _reader: asyncio.Task[None]) -> None:
        self._reading = False
        self._wake_writer()

    def _deadline(self, request: Req, now: float) -> float:
        """A message's deadline, monotonic: its own budget (or the server's), within the call's."""
        budget_s = self._message_budget(request) if not isinstance(request, Malformed) else None
        return self._deadline_for(budget_s, now)

    def _deadline_for(self, budget_s: float | None, now: float) -> float:
        deadline = now + (self._streams.budget.seconds if budget_s is None else budget_s)
        return min(deadline, self._call_deadline)

    def _arrival(self, request: Req) -> Arrival[Req, Resp]:
        """A message for `per_batch`, with the batcher's deadline (`Arrival`)."""
        now_ns = time.monotonic_ns()
        now = now_ns / 1e9
        budget_s = self._message_budget(request)
        remaining_s = self._deadline_for(budget_s, now) - now
        deadline = self._streams.budget.deadline(remaining_s)
        return Arrival(self, request, deadline, now_ns, (budget_s, self._call_deadline))

    def _refuse(self, request: Req, limit: int) -> None:
        """Answer a message beyond the stream's limit RESOURCE_EXHAUSTED, traced and counted
        as a refused call is (it never reaches the RPC boundary)."""
        received_ns = time.monotonic_ns()
        details = (
            f"more than {limit} messages in flight on this stream; "
            "wait for answers before sending more"
        )
        self._answer(self._error_reply(request, _RESOURCE_EXHAUSTED, details))
        telemetry = getattr(self._servicer, "telemetry", None)
        if telemetry is not None:
            method = self._method.per_message.__name__
            service = self._servicer.SERVICE_NAME
            count_refused_message(
                telemetry, service, method, self._metadata, received_ns, _RESOURCE_EXHAUSTED
            )

    def _start(self, request: Req) -> None:
        context = MessageContext(self._metadata, self._deadline(request, time.monotonic()))
        coro = self._per_message(self._servicer, request, context)
        message = _Message(self, coro, request, context)
        self._scoring.add(message)
        message.start()

    def _start_arrival(self, request: Req) -> None:
        self._batched -= 1
        self._start(request)

    def _answer_arrival(self, reply: Resp) -> None:
        self._batched -= 1
        self._answer(reply)

    def _finished(
        self, message: _Message[Req, Resp], reply: Resp | None, exc: BaseException | None
    ) -> None:
        self._scoring.discard(message)
        if exc is None:
            self._answer(reply)  # type: ignore[arg-type]
            return
        request, context = message.request, message.context
        if isinstance(exc, asyncio.CancelledError):
            self._answer(self._error_reply(request, _UNAVAILABLE, "the stream was closed"))
            return
        code = context.code()
        if code is _OK:  # the boundary maps every error to an abort; this is a safety net
            log.error("stream message failed outside the RPC boundary", exc_info=exc)
            code = grpc.StatusCode.INTERNAL
        self._answer(self._error_reply(request, code, context.details() or "internal error"))

    def _answer(self, reply: Resp) -> None:
        self._answers.append(reply)
        self._wake_writer()

    def _wake_writer(self) -> None:
        waiting = self._writer_waiting
        if waiting is not None and not waiting.done():
            waiting.set_result(None)
