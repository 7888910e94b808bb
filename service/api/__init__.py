"""The wire: gRPC servicers (thin: decode, await the batcher, encode) and what wraps them."""

from service.api.oip import InferenceServicer
from service.api.risk import RiskScoringServicer

__all__ = ["InferenceServicer", "RiskScoringServicer"]
