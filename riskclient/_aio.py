"""The asyncio client: unary calls, batches, and the shared stream."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from riskclient._base import ClientBase
from riskclient._errors import ScoringError
from riskclient._messages import RequestLike, as_request
from riskclient._stream import AsyncScoreStream
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

__all__ = ["AsyncRiskClient"]


class AsyncRiskClient(ClientBase):
    """Scores requests on a riskserve from asyncio code.

    Create and use it inside one running event loop.
    """

    def _open(self) -> None:
        self._channel = self.connection.aio_channel()
        self._stub = pb_grpc.RiskScoringStub(self._channel)

    async def __aenter__(self) -> AsyncRiskClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def score(
        self, request: RequestLike, *, timeout_s: float | None = None
    ) -> pb.ScoreResponse:
        """Score one request with a unary call; raises ScoringError when it is not scored."""
        message = as_request(request)
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
        self, *, resend_unanswered: bool = False, timeout_s: float | None = None
    ) -> AsyncScoreStream:
        """A stream client many tasks share: ``await stream.score(request)`` from each."""
        return AsyncScoreStream(
            self._channel,
            self._metadata,
            resend_unanswered=resend_unanswered,
            timeout_s=self._timeout(timeout_s),
            throttle=self.throttle,
        )
