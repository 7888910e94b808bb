"""What the blocking and the asyncio clients share: their connection and call defaults."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from riskclient._connection import Connection, default_target
from riskclient._errors import ScoringError
from riskclient._messages import RequestLike, as_request
from riskclient._throttle import AdaptiveThrottle
from riskscoring.v1 import risk_scoring_pb2 as pb

__all__ = ["ClientBase"]


class ClientBase:
    """Keyword arguments other than `target` build the `Connection` (TLS files, bearer token);
    `timeout_s` is the default deadline of each call (None: the server's budget applies).
    Without a `target` the client finds the server as the `riskserve` commands do, at
    RISKSERVE_HOST:RISKSERVE_PORT (default 127.0.0.1:50051).

    Unary and batch calls, and the messages of its streams, go through one `AdaptiveThrottle`
    (`throttle`: True, the default; an instance of your own; or False for none): while the
    server refuses calls as overloaded, the client refuses a share of them itself, at once,
    with RESOURCE_EXHAUSTED."""

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout_s: float | None = None,
        connection: Connection | None = None,
        throttle: AdaptiveThrottle | bool = True,
        **connection_settings: Any,
    ) -> None:
        if connection is None:
            connection = Connection(target or default_target(), **connection_settings)
        self.connection = connection
        self.timeout_s = timeout_s
        if isinstance(throttle, AdaptiveThrottle):
            self.throttle: AdaptiveThrottle | None = throttle
        else:
            self.throttle = AdaptiveThrottle() if throttle else None
        self._metadata = self.connection.metadata
        self._open()

    def _admit(self, request_id: str = "") -> None:
        """Raise the client's own RESOURCE_EXHAUSTED when the throttle refuses the call."""
        if self.throttle is not None and not self.throttle.allow():
            raise ScoringError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, self.throttle.refusal(), request_id
            )

    def _ended(self, code: grpc.StatusCode) -> None:
        if self.throttle is not None:
            self.throttle.record(code)

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
