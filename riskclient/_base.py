"""What the blocking and the asyncio clients share: their connection and call defaults."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from riskclient._connection import Connection
from riskclient._messages import RequestLike, as_request
from riskscoring.v1 import risk_scoring_pb2 as pb

__all__ = ["ClientBase"]


class ClientBase:
    """Keyword arguments other than `target` build the `Connection` (TLS files, bearer token);
    `timeout_s` is the default deadline of each call (None: the server's budget applies)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        timeout_s: float | None = None,
        connection: Connection | None = None,
        **connection_settings: Any,
    ) -> None:
        self.connection = connection or Connection(target, **connection_settings)
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
