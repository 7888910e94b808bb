"""The asyncio client: unary calls, batches, and the streams concurrent calls share."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import grpc

from riskclient._base import ClientBase
from riskclient._errors import ScoringError
from riskclient._messages import RequestLike, as_request
from riskclient._stream import CLOSE_GRACE_S, DEFAULT_MAX_IN_FLIGHT, AsyncScoreStream
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

__all__ = ["SHARED_STREAMS", "AsyncRiskClient"]

# The most ScoreStreams concurrent calls share (see AsyncRiskClient).
SHARED_STREAMS = 4
_READY = grpc.ChannelConnectivity.READY


class AsyncRiskClient(ClientBase):
    """Scores requests on a riskserve from asyncio code.

    Create and use it inside one running event loop. Concurrent `score()` calls share
    ScoreStreams (`shared_stream`, on by default): a call made while none is in flight is a
    unary call; once calls overlap, each goes on the open stream with the fewest requests in
    flight, and the client opens another, up to `shared_streams` (4), where each already
    carries one. The streams stay open until `close()`. A streamed request costs the server
    less than a unary call (258 against 393 µs of CPU at 64 callers, docs/benchmarks.md,
    "Streaming"). Each stream carries an adaptive window of requests unanswered
    (`AsyncScoreStream`); the rest wait here, each for at most a quarter of its timeout. Beyond
    a one-core worker's capacity, 64 callers got 2,744 answers a second in time on four shared
    streams, 2.7 times its unary capacity, where unary calls the front admits or refuses got
    1,200 (docs/benchmarks.md, "Overload"). Several streams, not one: the client reads a
    stream's answers one a turn of its event loop, and behind the front each stream stays on
    the worker it reached. A call whose request_id is already in flight on a stream, or was
    given up there (timed out, cancelled) with its answer still due, is a unary call, and so
    is every call while the channel has no connection up: it fails fast where the server is
    down, as a stream would not.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        shared_stream: bool = True,
        shared_streams: int = SHARED_STREAMS,
        **settings: Any,
    ) -> None:
        if shared_streams < 1:
            raise ValueError("shared_streams must be at least 1")
        self.shared_stream = shared_stream
        self.shared_streams = shared_streams
        self._calls = 0  # score() calls in flight
        self._shared: list[AsyncScoreStream] = []
        self._closed = False
        super().__init__(target, **settings)

    def _open(self) -> None:
        self._channel = self.connection.aio_channel()
        self._stub = pb_grpc.RiskScoringStub(self._channel)

    async def __aenter__(self) -> AsyncRiskClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def shared(self) -> tuple[AsyncScoreStream, ...]:
        """The streams concurrent calls share, opened as calls overlapped (none before)."""
        return tuple(self._shared)

    async def close(self, grace_s: float | None = CLOSE_GRACE_S) -> None:
        """End the shared streams once their requests are answered, waiting up to `grace_s`
        (None: for good; see `AsyncScoreStream.close`), then the channel."""
        self._closed = True
        shared, self._shared = self._shared, []
        try:
            await asyncio.gather(*(stream.close(grace_s) for stream in shared))
        finally:
            await self._channel.close()

    async def score(
        self, request: RequestLike, *, timeout_s: float | None = None
    ) -> pb.ScoreResponse:
        """Score one request, on a shared stream where calls overlap (see the class) or with
        a unary call; raises ScoringError when it is not scored."""
        message = as_request(request)
        stream = self._stream_for(message.request_id)
        self._calls += 1
        try:
            if stream is not None:
                return await stream.score(message, timeout_s=timeout_s)
            return await self._score_unary(message, timeout_s)
        finally:
            self._calls -= 1

    def _stream_for(self, request_id: str) -> AsyncScoreStream | None:
        """The shared stream for a request, opened now if calls overlap; None: a unary call."""
        if not self.shared_stream or self._closed:
            return None
        shared = self._shared
        if not shared and self._calls == 0:
            return None
        if self._channel.get_state() is not _READY:
            # No connection up (the server down, or being reached): a unary call fails fast
            # with UNAVAILABLE and the throttle hears it, where a stream would wait for one.
            return None
        if request_id and any(stream.carries(request_id) for stream in shared):
            return None
        least = min(shared, key=lambda stream: stream.in_flight, default=None)
        if least is None or (least.in_flight and len(shared) < self.shared_streams):
            least = self.stream()
            shared.append(least)
        return least

    async def _score_unary(
        self, message: pb.ScoreRequest, timeout_s: float | None
    ) -> pb.ScoreResponse:
        self._admit(message.request_id)
        try:
            reply = await self._stub.Score(
                message, timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        except grpc.RpcError as exc:
            error = ScoringError.from_rpc_error(exc, message.request_id)
            self._ended(error.code)
            raise error from exc
        self._ended(grpc.StatusCode.OK)
        return reply

    async def score_batch(
        self,
        requests: Iterable[RequestLike],
        *,
        model: str = "",
        model_version: str = "",
        timeout_s: float | None = None,
    ) -> list[pb.ScoreResponse]:
        """Score requests of one model together; responses in request order."""
        batch = self._batch(requests, model, model_version)
        self._admit()
        try:
            reply = await self._stub.ScoreBatch(
                batch, timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        except grpc.RpcError as exc:
            error = ScoringError.from_rpc_error(exc)
            self._ended(error.code)
            raise error from exc
        self._ended(grpc.StatusCode.OK)
        return list(reply.responses)

    def stream(
        self,
        *,
        resend_unanswered: bool = False,
        timeout_s: float | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> AsyncScoreStream:
        """A stream client many tasks share: ``await stream.score(request)`` from each; at most
        `max_in_flight` requests are on the stream unanswered at once, the rest wait here."""
        return AsyncScoreStream(
            self._channel,
            self._metadata,
            resend_unanswered=resend_unanswered,
            timeout_s=self._timeout(timeout_s),
            throttle=self.throttle,
            max_in_flight=max_in_flight,
        )
