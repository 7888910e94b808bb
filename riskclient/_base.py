"""What the blocking and the asyncio clients share: their connection and call defaults."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from riskclient._connection import Connection, default_target
from riskclient._messages import RequestLike, as_request
from riskscoring.v1 import risk_scoring_pb2 as pb

__all__ = ["ClientBase"]


class ClientBase:
    """Keyword arguments other than `target` build the `Connection` (TLS files, bearer token);
    `timeout_s` is the default deadline of each call (None: the server's budget applies).
    Without a `target` the client finds the server as the `riskserve` commands do, at
    RISKSERVE_HOST:RISKSERVE_PORT (default 127.0.0.1:50051)."""

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout_s: float | None = None,
        connection: Connection | None = None,
        **connection_settings: Any,
    ) -> None:
        if connection is None:
            connection = Connection(target or default_target(), **connection_settings)
        self.connection = connection
        self.timeout_s = timeout_s
        self._metadata = self.connection.metadata
        self._open()

    def _open(self) -> None:
        """Make the channel and stub (each client's own kind)."""
        raise NotImplementedError

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.timeout_s if timeout_s is None else timeout_s

    @staticmethod
    def _batch(
        requests: Iterable[RequestLike], model: str, model_version: str
    ) -> pb.ScoreBatchRequest:
        return pb.ScoreBatchRequest(
            model=model, model_version=model_version, requests=[as_request(r) for r in requests]
        )
