"""gRPC servicers: thin layers that decode, await the batcher, and encode."""

from service.handlers.oip import InferenceServicer
from service.handlers.risk import RiskScoringServicer

__all__ = ["InferenceServicer", "RiskScoringServicer"]
