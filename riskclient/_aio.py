"""The asyncio client: unary calls, batches, and the shared stream."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from riskclient._base import ClientBase
from riskclient._errors import ScoringError
from riskclient._messages import RequestLike, as_request
from riskclient._stream import DEFAULT_MAX_IN_FLIGHT, AsyncScoreStream
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

__all__ = ["AsyncRiskClient"]


class AsyncRiskClient(ClientBase):
    """Scores requests on a riskserve from asyncio code.

    Create and use it inside one running event loop. With `shared_stream=True`, concurrent
    `score()` calls share one ScoreStream: the first time a call is made while another is in
    flight, the client opens the stream, and from then on every `score()` goes on it until
    `close()`. A streamed request costs the server less than a unary call (330 against 462 µs
    of CPU at 64 callers, docs/benchmarks.md, "Streaming"). The stream carries an adaptive
    window of requests unanswered (`AsyncScoreStream`); the rest wait here. Calls made one at
    a time stay unary calls, and so does a call whose request_id is already in flight on the
    stream. It is off by default: a stream passes the front's per-worker limit and queue, and
    beyond capacity 64 callers on the shared stream got 0.54 to 0.72 of a one-core worker's
    capacity answered in time, against 1.2 with unary calls the front admits or refuses
    (`bench.overload`). Behind the front with several workers, a stream also stays on the
    worker it reached.
    """

    def __init__(
        self, target: str | None = None, *, shared_stream: bool = False, **settings: Any
    ) -> None:
        self.shared_stream = shared_stream
        self._calls = 0  # score() calls in flight
        self._shared: AsyncScoreStream | None = None
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
    def shared(self) -> AsyncScoreStream | None:
        """The stream concurrent calls share, once calls have overlapped (None before)."""
        return self._shared

    async def close(self) -> None:
        """End the shared stream once its requests are answered, then the channel."""
        self._closed = True
        shared, self._shared = self._shared, None
        if shared is not None:
            await shared.close()
        await self._channel.close()

    async def score(
        self, request: RequestLike, *, timeout_s: float | None = None
    ) -> pb.ScoreResponse:
        """Score one request, on the shared stream where calls overlap (see the class) or with
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
        if self._shared is None:
            if self._calls == 0:
                return None
            self._shared = self.stream()
        if request_id and self._shared.carries(request_id):
            return None
        return self._shared

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
