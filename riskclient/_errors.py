"""The client's errors.

Exception tree::

    RiskClientError
    ├── ScoringError     the server (or the call) ended a request with a non-OK status
    └── StreamClosed     the stream client was closed before the request was answered

A `ScoringError` carries the gRPC status `code`, the server's `message` (naming the field for
INVALID_ARGUMENT) and the `request_id` it answers.
"""

from __future__ import annotations

import grpc

__all__ = ["RiskClientError", "ScoringError", "StreamClosed", "status_code"]

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The gRPC status code with this number (UNKNOWN for a number gRPC does not define)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


class RiskClientError(Exception):
    """Base of the client's errors."""


class ScoringError(RiskClientError):
    """A request was not scored: the status the server or the call ended it with."""

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str = "") -> None:
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self.code = code
        self.message = message
        self.request_id = request_id

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError, request_id: str = "") -> ScoringError:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "", request_id)


class StreamClosed(RiskClientError):
    """The stream client was closed; a request sent after, or not answered before, fails so."""
