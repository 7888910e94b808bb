"""The blocking client: unary calls, batches, and a shared stream for many threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from typing import Any

import grpc

from riskclient._base import ClientBase
from riskclient._connection import Connection
from riskclient._errors import ScoringError, StreamClosed
from riskclient._messages import RequestLike, as_request
from riskclient._stream import CLOSE_GRACE_S, AsyncScoreStream
from riskclient._throttle import AdaptiveThrottle
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

__all__ = ["RiskClient", "ScoreStream"]


class RiskClient(ClientBase):
    """Scores requests on a riskserve from blocking code."""

    def _open(self) -> None:
        self._channel = self.connection.channel()
        self._stub = pb_grpc.RiskScoringStub(self._channel)

    def __enter__(self) -> RiskClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def score(self, request: RequestLike, *, timeout_s: float | None = None) -> pb.ScoreResponse:
        """Score one request with a unary call; raises ScoringError when it is not scored."""
        message = as_request(request)
        self._admit(message.request_id)
        try:
            reply = self._stub.Score(
                message, timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        except grpc.RpcError as exc:
            error = ScoringError.from_rpc_error(exc, message.request_id)
            self._ended(error.code)
            raise error from exc
        self._ended(grpc.StatusCode.OK)
        return reply

    def score_batch(
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
            reply = self._stub.ScoreBatch(
                batch, timeout=self._timeout(timeout_s), metadata=self._metadata
            )
        except grpc.RpcError as exc:
            error = ScoringError.from_rpc_error(exc)
            self._ended(error.code)
            raise error from exc
        self._ended(grpc.StatusCode.OK)
        return list(reply.responses)

    def stream(
        self, *, resend_unanswered: bool = False, timeout_s: float | None = None
    ) -> ScoreStream:
        """A stream client many threads share: ``stream.score(request)`` from each."""
        return ScoreStream(
            self.connection,
            resend_unanswered=resend_unanswered,
            timeout_s=self._timeout(timeout_s),
            throttle=self.throttle,
        )


class ScoreStream:
    """One ScoreStream call shared by many threads; its event loop runs on a thread of its own."""

    def __init__(
        self,
        connection: Connection,
        *,
        resend_unanswered: bool = False,
        timeout_s: float | None = None,
        throttle: AdaptiveThrottle | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        # Held to hand the loop a request, and to close: nothing reaches a stopped loop.
        self._submitting = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="riskclient-stream", daemon=True
        )
        self._thread.start()

        async def start() -> tuple[grpc.aio.Channel, AsyncScoreStream]:
            channel = connection.aio_channel()
            stream = AsyncScoreStream(
                channel,
                connection.metadata,
                resend_unanswered=resend_unanswered,
                timeout_s=timeout_s,
                throttle=throttle,
            )
            return channel, stream

        try:
            self._channel, self._stream = self._run(start())
        except BaseException:  # no stream to close: end the loop and its thread here
            self._stop_loop()
            raise

    def __enter__(self) -> ScoreStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def reconnects(self) -> int:
        """Streams that ended before their requests were answered, so far."""
        return self._stream.reconnects

    @property
    def sent_unanswered(self) -> int:
        """Requests the current stream has sent and not had answered."""
        return self._stream.sent_unanswered

    def score(self, request: RequestLike, *, timeout_s: float | None = None) -> pb.ScoreResponse:
        """Score one request on the shared stream; raises ScoringError when it is not scored,
        StreamClosed once the stream is closed."""
        with self._submitting:
            if self._closed:
                raise StreamClosed("the stream client is closed")
            scored = asyncio.run_coroutine_threadsafe(
                self._stream.score(request, timeout_s=timeout_s), self._loop
            )
        return scored.result()

    def close(self, grace_s: float | None = CLOSE_GRACE_S) -> None:
        """Wait up to `grace_s` (None: for good) for the requests sent to be answered, then
        end the stream and its thread (see `AsyncScoreStream.close`)."""
        with self._submitting:
            if self._closed or not self._thread.is_alive():
                return
            self._closed = True
        try:
            self._run(self._stream.close(grace_s))
            self._run(self._channel.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
