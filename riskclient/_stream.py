"""One ScoreStream shared by many concurrent callers.

Each `score()` call puts its request on the one stream and waits on its own future, found
again by `request_id` when the answer arrives (answers come in completion order). When the
stream ends without being closed (the server drained with UNAVAILABLE, or the connection
broke) the next stream opens at once, waiting for the server to be ready; the requests that
were sent and not answered are sent again on it (`resend_unanswered=True`) or fail with
UNAVAILABLE. A request whose `timeout_s` passes fails with DEADLINE_EXCEEDED, and the server is
told the same budget in the message's `timeout_us`.

A window bounds the requests on the stream unanswered; the rest wait in the client. A stream
passes the front's per-worker limit and queue (docs/reliability.md), so the window is what keeps
many callers on one stream from piling more on a worker than it answers in time. How many that
is depends on the server's speed and the deadline, so the window adapts (additive increase,
multiplicative decrease, as TCP's congestion window): it grows by one a window's worth of
answers that came within half their timeout, and halves, at most once a window's worth of
answers, when one comes later, fails as overloaded or late, or times out on the stream; it
stays within 1 and `max_in_flight`.

A request that waits in the client for a place in the window longer than a quarter of its
timeout fails there with RESOURCE_EXHAUSTED, never sent, as the front refuses a call that
waited a quarter of the budget for a worker: beyond capacity the requests waiting here would
otherwise all wait out their timeouts in turn, and none would leave early enough to be answered
in time. The wait also paces callers that try again at once.

The window is the stream's throttle: a stream never refuses a request at once, as the client's
adaptive throttle refuses unary calls. Refused at once, callers that try again at once take the
client's event loop, which reads the stream's answers one a turn, and answers came late for
want of turns (docs/reliability.md). The stream tells the throttle how its sent requests ended,
for the client's unary calls; a request that never reached the server says nothing of it and
is not counted.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
from collections import deque
from collections.abc import AsyncIterator, Sequence

import grpc

from riskclient._errors import ScoringError, StreamClosed, status_code
from riskclient._messages import RequestLike, as_request
from riskclient._throttle import AdaptiveThrottle
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

__all__ = ["CLOSE_GRACE_S", "DEFAULT_MAX_IN_FLIGHT", "AsyncScoreStream"]

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
# The most requests a stream carries unanswered at once when not told otherwise.
DEFAULT_MAX_IN_FLIGHT = 64
# Where the window starts: the front's calls a worker (service.front_limits.DEFAULT_WORKER_CALLS).
_FIRST_WINDOW = 8.0
# Answers that say the server is past what it answers in time.
_OVERLOADED = frozenset({_RESOURCE_EXHAUSTED, _DEADLINE_EXCEEDED, _UNAVAILABLE})
# How long close() waits for the requests sent to be answered when not told otherwise.
CLOSE_GRACE_S = 5.0
# The share of a request's timeout it may wait here for a place in the window (the front's
# queue time is a quarter of the budget too: service.front_limits.queue_timeout_ms).
_QUEUE_SHARE = 0.25
# Dead requests the outbox may hold beyond twice the live ones before it is swept.
_OUTBOX_SLACK = 64


class _Pending:
    """A request on its way: its future, whether the current stream took it, its timer."""

    __slots__ = ("future", "request", "sent", "sent_at", "soon_s", "timer")

    def __init__(
        self,
        request: pb.ScoreRequest,
        future: asyncio.Future[pb.ScoreResponse],
        timeout_s: float | None,
    ):
        self.request = request
        self.future = future
        self.sent = False
        self.sent_at = 0.0  # the loop's time when the current stream took it
        # An answer later than this (half the timeout) shrinks the window.
        self.soon_s = math.inf if timeout_s is None else timeout_s / 2
        self.timer: asyncio.TimerHandle | None = None


class AsyncScoreStream:
    """Many concurrent `score()` calls multiplexed on one ScoreStream call.

    Use it from one event loop; close it (or use ``async with``) to end the stream after the
    requests already sent are answered.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        metadata: Sequence[tuple[str, str]] = (),
        *,
        resend_unanswered: bool = False,
        timeout_s: float | None = None,
        throttle: AdaptiveThrottle | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self._stub = pb_grpc.RiskScoringStub(channel)
        self.max_in_flight = max_in_flight
        self._on_stream = 0  # requests the current stream has sent and not had answered
        self._window = min(_FIRST_WINDOW, float(max_in_flight))
        self._since_cut = 0  # answers since the window last halved
        self.throttle = throttle
        self._metadata = tuple(metadata)
        self.resend_unanswered = resend_unanswered
        self._timeout_s = timeout_s
        self._pending: dict[str, _Pending] = {}
        # Ids the current stream sent whose callers gave up (timed out, cancelled): their
        # answers are still due, and must not answer a request sent again under the same id.
        self._given_up: set[str] = set()
        self._outbox: deque[_Pending] = deque()
        self._wake_sender: asyncio.Future[None] | None = None
        self._has_work: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._opened = False  # whether the server has answered the current stream's start
        self._closing = False
        self._generation = 0
        self._ids = itertools.count()
        self._id_prefix = f"{os.getpid():x}-{id(self):x}-"
        self.reconnects = 0
        self.answered = 0

    async def __aenter__(self) -> AsyncScoreStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        """Requests waiting for their answers, sent or queued."""
        return len(self._pending)

    def carries(self, request_id: str) -> bool:
        """Whether a request with this id is in flight on the stream, or was sent and given up
        with its answer still due (ids must be unique among them)."""
        return request_id in self._pending or request_id in self._given_up

    @property
    def sent_unanswered(self) -> int:
        """Requests the current stream has sent and not had answered."""
        return sum(1 for p in self._pending.values() if p.sent and not p.future.done())

    async def score(
        self, request: RequestLike, *, timeout_s: float | None = None
    ) -> pb.ScoreResponse:
        """Score one request on the shared stream; raises ScoringError when it is not scored."""
        if self._closing:
            raise StreamClosed("the stream client is closed")
        message = as_request(request)
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        request_id = message.request_id
        copy_needed = not request_id or (timeout_s is not None and not message.timeout_us)
        if copy_needed:
            copied = pb.ScoreRequest()
            copied.CopyFrom(message)
            message = copied
            if not request_id:
                request_id = message.request_id = f"{self._id_prefix}{next(self._ids)}"
            if timeout_s is not None and not message.timeout_us:
                message.timeout_us = max(1, int(timeout_s * 1e6))
        if request_id in self._pending:
            raise ValueError(f"request_id {request_id!r} is already in flight on this stream")
        if request_id in self._given_up:
            raise ValueError(
                f"request_id {request_id!r} was sent on this stream and its answer is still "
                "due; send it again with a unary call, or once that answer has come"
            )
        loop = asyncio.get_running_loop()
        pending = _Pending(message, loop.create_future(), timeout_s)
        self._pending[request_id] = pending
        if timeout_s is not None:
            wait_s = timeout_s * _QUEUE_SHARE
            pending.timer = loop.call_later(wait_s, self._waited, request_id, wait_s, timeout_s)
        outbox = self._outbox
        if len(outbox) > 2 * len(self._pending) + _OUTBOX_SLACK:
            # A request failed before it was sent (timed out, given up) stays queued until the
            # sender passes it by; while nothing is sent (no server up, a window full) such
            # requests would pile up here for good. The sender holds this deque: kept, not
            # replaced.
            live = [p for p in outbox if not p.future.done()]
            outbox.clear()
            outbox.extend(live)
        outbox.append(pending)
        self._wake()
        if self._runner is None:
            self._has_work = asyncio.Event()
            self._runner = loop.create_task(self._run())
        try:
            reply = await pending.future
        except ScoringError as exc:
            if self.throttle is not None and pending.sent_at:
                self.throttle.record(exc.code)
            raise
        finally:
            if self._pending.get(request_id) is pending:  # its caller gave up (cancelled)
                del self._pending[request_id]
                if pending.sent:
                    self._given_up.add(request_id)
            if pending.timer is not None:
                pending.timer.cancel()
        if self.throttle is not None:
            self.throttle.record(grpc.StatusCode.OK)
        return reply

    async def close(self, grace_s: float | None = CLOSE_GRACE_S) -> None:
        """Stop taking requests, wait up to `grace_s` (None: for good) for those sent to be
        answered, and end the stream; what is still unanswered then fails with
        StreamClosed. A server that stops answering without closing the connection would
        otherwise hold close(), and whatever shuts down with it, for as long as it is gone."""
        self._closing = True
        self._wake()
        if not self._pending and self._call is not None and not self._opened:
            # Nothing to wait for, and no server has answered the stream yet: do not wait
            # for one to come.
            self._call.cancel()
        runner = self._runner
        if runner is not None:
            try:
                _, waiting = await asyncio.wait({runner}, timeout=grace_s)
                if waiting:
                    self._fail_pending()
                    if self._call is not None:
                        self._call.cancel()
                    runner.cancel()
                    await asyncio.gather(runner, return_exceptions=True)
            finally:
                self._runner = None
        self._fail_pending()

    def _fail_pending(self, why: str = "the stream client was closed") -> None:
        for pending in tuple(self._pending.values()):
            _fail(pending, StreamClosed(f"{why} before this was answered"))
        self._pending.clear()

    def _wake(self) -> None:
        waiting = self._wake_sender
        if waiting is not None and not waiting.done():
            waiting.set_result(None)
        if self._has_work is not None:
            self._has_work.set()

    def _waited(self, request_id: str, waited_s: float, timeout_s: float) -> None:
        """A quarter of a request's timeout has passed: fail it if it is still waiting here
        while the open stream's window is full, else give it the rest of its timeout (a
        stream still opening, or a place free that the sender has yet to fill, is no sign of
        overload)."""
        pending = self._pending.get(request_id)
        if pending is None:
            return
        if pending.sent or not self._opened or self._on_stream < int(self._window):
            pending.timer = asyncio.get_running_loop().call_later(
                timeout_s - waited_s, self._expire, request_id
            )
            return
        del self._pending[request_id]
        message = (
            f"not sent on the stream within {waited_s * 1e3:.3g} ms, a quarter of the timeout "
            "(its window of requests unanswered was full); nothing was sent"
        )
        _fail(pending, ScoringError(_RESOURCE_EXHAUSTED, message, request_id))

    def _expire(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            if pending.sent:
                self._given_up.add(request_id)
            _fail(
                pending,
                ScoringError(_DEADLINE_EXCEEDED, "no answer within the call's timeout", request_id),
            )

    async def _run(self) -> None:
        try:
            await self._streams()
        finally:
            if not self._closing:  # ended by itself: its channel closed, or its task cancelled
                self._closing = True
                self._fail_pending("the stream client's channel was closed")

    async def _streams(self) -> None:
        """Open a stream, answer what it carries, and open the next when it breaks."""
        assert self._has_work is not None
        backoff_s = _FIRST_BACKOFF_S
        while True:
            self._has_work.clear()
            if self._closing and not self._pending:
                return
            if not self._outbox and not self._pending:
                await self._has_work.wait()
                continue
            answered = self.answered
            code, details = await self._one_stream()
            self._generation += 1
            self._on_stream = 0
            self._given_up.clear()  # their answers were due on the stream that ended
            # gRPC leaves a failed call's request generator waiting: wake it to see its stream
            # is gone and end, before the next stream's generator waits in its turn.
            self._wake()
            self._after_stream(code, details)
            if self.answered > answered or code is grpc.StatusCode.OK:
                backoff_s = _FIRST_BACKOFF_S
            else:
                # A server that ends streams at once (draining, say) is not asked again at once.
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, _MAX_BACKOFF_S)

    @property
    def window(self) -> int:
        """Requests the stream may carry unanswered now."""
        return int(self._window)

    def _adapt(self, late: bool) -> None:
        """One answer came back: grow the window, or halve it where the answer was late."""
        self._since_cut += 1
        if late:
            if self._since_cut >= self._window:
                self._window = max(1.0, self._window / 2)
                self._since_cut = 0
        else:
            self._window = min(float(self.max_in_flight), self._window + 1 / self._window)
        if self._on_stream < int(self._window):
            self._wake()  # a place on the stream is free

    async def _one_stream(self) -> tuple[grpc.StatusCode, str]:
        loop = asyncio.get_running_loop()
        call = self._stub.ScoreStream(
            self._requests(self._generation), metadata=self._metadata, wait_for_ready=True
        )
        self._call = call
        self._opened = False
        pending = self._pending
        try:
            async for reply in call:
                self.answered += 1
                self._on_stream -= 1
                if reply.request_id in self._given_up:
                    self._given_up.discard(reply.request_id)
                    self._adapt(late=True)
                    continue
                entry = pending.pop(reply.request_id, None)
                if entry is None or entry.future.done():
                    self._adapt(late=True)  # timed out already
                    continue
                status = reply.status
                late = status.code and status_code(status.code) in _OVERLOADED
                self._adapt(late or loop.time() - entry.sent_at > entry.soon_s)
                if status.code:
                    entry.future.set_exception(
                        ScoringError(status_code(status.code), status.message, reply.request_id)
                    )
                else:
                    entry.future.set_result(reply)
            return await call.code(), await call.details() or ""
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        except asyncio.CancelledError:
            if not (self._closing and call.cancelled()):
                raise
            return grpc.StatusCode.CANCELLED, "closed before a server answered"

    def _after_stream(self, code: grpc.StatusCode, details: str) -> None:
        """Settle the requests the ended stream took and did not answer."""
        unanswered = [p for p in self._pending.values() if p.sent and not p.future.done()]
        if code is grpc.StatusCode.OK and not unanswered:
            return
        self.reconnects += 1
        retry = code in (_UNAVAILABLE, grpc.StatusCode.OK) and self.resend_unanswered
        for pending in unanswered:
            pending.sent = False
            if retry and not self._closing:
                self._outbox.appendleft(pending)
            else:
                request_id = pending.request.request_id
                message = details or "the stream ended before this request was answered"
                failed_with = _UNAVAILABLE if code is grpc.StatusCode.OK else code
                self._pending.pop(request_id, None)
                _fail(pending, ScoringError(failed_with, message, request_id))
        if code not in (_UNAVAILABLE, grpc.StatusCode.OK):
            # Not a broken connection (refused credentials, say): the queued requests would
            # meet the same answer.
            while self._outbox:
                pending = self._outbox.popleft()
                self._pending.pop(pending.request.request_id, None)
                _fail(pending, ScoringError(code, details, pending.request.request_id))

    async def _requests(self, generation: int) -> AsyncIterator[pb.ScoreRequest]:
        """What the stream of `generation` sends; it ends (half-closing) once closing and idle."""
        outbox = self._outbox
        loop = asyncio.get_running_loop()
        call = self._call
        # The server sends its headers as a stream opens. Until they come the call may yet be
        # refused (a wrong token, say), and a write racing that refusal turns its status into
        # INTERNAL; after them a refused call is done and nothing is written.
        if call is not None:
            await call.initial_metadata()
            if call.done():
                return
            self._opened = True
        while generation == self._generation:
            while outbox and self._on_stream < int(self._window):
                pending = outbox.popleft()
                if pending.future.done():
                    continue  # timed out while queued
                pending.sent = True
                pending.sent_at = loop.time()
                self._on_stream += 1
                yield pending.request
                if generation != self._generation:
                    return
            if self._closing and not outbox:
                return
            wake = self._wake_sender = loop.create_future()
            try:
                await wake
            finally:
                # Only its own: a generator of an ended stream must not take the wake-up of
                # the next stream's, which would then wait with requests queued.
                if self._wake_sender is wake:
                    self._wake_sender = None


def _fail(pending: _Pending, exc: Exception) -> None:
    if not pending.future.done():
        pending.future.set_exception(exc)
