"""The service's errors, and the one table that maps them to gRPC status codes.

Exception tree::

    ServiceError
    ├── InvalidRequest     a field breaks the model's manifest           INVALID_ARGUMENT
    ├── ModelNotFound      no such model or version                      NOT_FOUND
    ├── Overloaded         the model's queue is full                     RESOURCE_EXHAUSTED
    ├── DeadlineMissed     the request can no longer meet its deadline   DEADLINE_EXCEEDED
    ├── Unavailable        shutting down, or the model is not ready      UNAVAILABLE
    └── ScoringFailed      every engine, the fallback too, failed        INTERNAL

Anything else reaching the gRPC boundary is INTERNAL with a generic message.
"""

from __future__ import annotations

import grpc

__all__ = [
    "DeadlineMissed",
    "InvalidRequest",
    "ModelNotFound",
    "Overloaded",
    "ScoringFailed",
    "ServiceError",
    "Unavailable",
    "status_for",
]


class ServiceError(Exception):
    """Base of errors whose message is safe to send to the caller."""


class InvalidRequest(ServiceError):
    """A request field does not satisfy the model's manifest."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class ModelNotFound(ServiceError):
    """The named model or version is not loaded."""


class Overloaded(ServiceError):
    """The queue for the model is full; the caller should back off."""


class DeadlineMissed(ServiceError):
    """The request's deadline cannot be met."""


class Unavailable(ServiceError):
    """The server is draining or the model is not ready yet."""


class ScoringFailed(ServiceError):
    """No engine could score the batch."""


_STATUS: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineMissed: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    ScoringFailed: grpc.StatusCode.INTERNAL,
}


def status_for(exc: ServiceError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return grpc.StatusCode.INTERNAL
