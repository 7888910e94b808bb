"""The wire: gRPC servicers (thin: decode, await the batcher, encode) and what wraps them.

`risk.RiskScoringServicer` and `oip.InferenceServicer` serve the two APIs; `codec` converts
protobuf to rows and back; `boundary`, `admission` and `registration` wrap every call.
"""
