"""Requests in, responses out: a ScoreRequest or its JSON-shaped dict; a failed answer raised."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

from google.protobuf import json_format

from riskclient._errors import ScoringError, status_code
from riskscoring.v1 import risk_scoring_pb2 as pb

__all__ = ["RequestLike", "as_request", "checked"]

# A ScoreRequest, or a dict in its JSON form: {"request_id": ..., "features": {...}, ...}.
RequestLike: TypeAlias = pb.ScoreRequest | Mapping[str, Any]


def as_request(request: RequestLike) -> pb.ScoreRequest:
    if isinstance(request, pb.ScoreRequest):
        return request
    return json_format.ParseDict(request, pb.ScoreRequest())


def checked(reply: pb.ScoreResponse) -> pb.ScoreResponse:
    """`reply`, or ScoringError when it carries a failed status (a stream's per-message one)."""
    status = reply.status
    if status.code:
        raise ScoringError(status_code(status.code), status.message, reply.request_id)
    return reply
