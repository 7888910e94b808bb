"""A Python client for riskserve: unary and batch calls, and streams shared by many callers.

    from riskclient import AsyncRiskClient

    async with AsyncRiskClient("127.0.0.1:50051") as client:
        async with client.stream() as stream:
            reply = await stream.score({"request_id": "t-1", "features": {...}})

It needs gRPC and protobuf only: no model runtime, nothing of the server.
"""

from riskclient._aio import AsyncRiskClient
from riskclient._connection import Connection
from riskclient._errors import RiskClientError, ScoringError, StreamClosed
from riskclient._messages import RequestLike
from riskclient._stream import AsyncScoreStream
from riskclient._sync import RiskClient, ScoreStream
from riskclient._throttle import AdaptiveThrottle
from riskscoring.v1.risk_scoring_pb2 import (
    Decision,
    HistoryRow,
    ScoreBatchRequest,
    ScoreRequest,
    ScoreResponse,
)

__all__ = [
    "AdaptiveThrottle",
    "AsyncRiskClient",
    "AsyncScoreStream",
    "Connection",
    "Decision",
    "HistoryRow",
    "RequestLike",
    "RiskClient",
    "RiskClientError",
    "ScoreBatchRequest",
    "ScoreRequest",
    "ScoreResponse",
    "ScoreStream",
    "ScoringError",
    "StreamClosed",
]
