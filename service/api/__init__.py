"""gRPC servicers: thin layers that decode, await the batcher, and encode."""

from service.api.oip import InferenceServicer
from service.api.risk import RiskScoringServicer

__all__ = ["InferenceServicer", "RiskScoringServicer"]
