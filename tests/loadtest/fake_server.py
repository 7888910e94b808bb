"""A stand-in riskserve for testing the load test itself: same services, trivial scoring.

    python tests/loadtest/fake_server.py [--port P]   # prints "PORT <n>" once listening

Requests are decoded and validated by the server's own codec against a manifest of the
stand-in model, so they are refused with the real server's statuses and messages (unknown
feature names and NaN are INVALID_ARGUMENT); histories longer than 64 rows are "served by the
fallback". A locust run against it exercises every task and the expected-invalid accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engines.manifest import HistorySpec, Manifest, Thresholds
from inference import grpc_service_pb2, grpc_service_pb2_grpc
from riskscoring.v1 import risk_scoring_pb2, risk_scoring_pb2_grpc
from service.api.codec import (
    DECISIONS,
    decode_infer_request,
    decode_score_batch,
    decode_score_request,
    encode_infer_response,
)
from service.batching.rows import RowBatch
from service.errors import ServiceError, status_for

MODEL = "fake-model"
VERSION = "1"
FEATURES = (*(f"f{i:02d}" for i in range(30)), "amount", "is_foreign")
HISTORY_FIELDS = ("amount", "seconds_since", "merchant_risk", "is_online")
PRIMARY_MAX_ROWS = 64
MAX_ROWS = 256
MANIFEST = Manifest(
    name=MODEL,
    version=VERSION,
    features=FEATURES,
    history=HistorySpec(fields=HISTORY_FIELDS, max_length=MAX_ROWS),
    thresholds=Thresholds(review=0.5, decline=0.7),
    max_batch_size=64,
)
# --lenient: a server bug the load test must catch: unknown features are ignored, NaN is zeroed.
LENIENT_MANIFEST = MANIFEST.model_copy(update={"nan_policy": "zero"})
LENIENT = False


def _lenient(request: risk_scoring_pb2.ScoreRequest) -> risk_scoring_pb2.ScoreRequest:
    for name in set(request.features) - set(FEATURES):
        del request.features[name]
    return request


def _decode(request: risk_scoring_pb2.ScoreRequest) -> RowBatch:
    if LENIENT:
        return decode_score_request(_lenient(request), LENIENT_MANIFEST)
    return decode_score_request(request, MANIFEST)


def _scores(features: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.tanh(features.sum(axis=1) / 1000.0)))


def _response(
    request: risk_scoring_pb2.ScoreRequest, score: float
) -> risk_scoring_pb2.ScoreResponse:
    long_history = len(request.history) > PRIMARY_MAX_ROWS
    return risk_scoring_pb2.ScoreResponse(
        request_id=request.request_id,
        score=score,
        decision=DECISIONS[MANIFEST.thresholds.decide(score)],
        model=MODEL,
        model_version=VERSION,
        engine="fake-fallback" if long_history else "fake-primary",
        fallback_reason="history_length" if long_history else "",
    )


async def _refuse(context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
    await context.abort(status_for(exc), str(exc))


class RiskScoring(risk_scoring_pb2_grpc.RiskScoringServicer):
    async def Score(self, request, context):
        try:
            rows = _decode(request)
        except ServiceError as exc:
            await _refuse(context, exc)
        return _response(request, float(_scores(rows.features)[0]))

    async def ScoreBatch(self, request, context):
        try:
            if LENIENT:
                for item in request.requests:
                    _lenient(item)
            parts = decode_score_batch(request, LENIENT_MANIFEST if LENIENT else MANIFEST)
        except ServiceError as exc:
            await _refuse(context, exc)
        scores = _scores(np.concatenate([part.features for part in parts])).tolist()
        pairs = zip(request.requests, scores, strict=True)
        return risk_scoring_pb2.ScoreBatchResponse(responses=[_response(r, s) for r, s in pairs])

    async def GetModelInfo(self, request, context):
        return risk_scoring_pb2.ModelInfo(
            model=MODEL,
            model_version=VERSION,
            versions=[VERSION],
            feature_names=FEATURES,
            history_fields=HISTORY_FIELDS,
            max_history_length=MAX_ROWS,
            max_score_batch_requests=MANIFEST.max_batch_size,
            nan_policy=MANIFEST.nan_policy,
        )


class Inference(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    async def ModelMetadata(self, request, context):
        meta = grpc_service_pb2.ModelMetadataResponse(name=MODEL, versions=[VERSION])
        meta.inputs.add(name="features", datatype="FP32", shape=[-1, len(FEATURES)])
        meta.inputs.add(name="history", datatype="FP32", shape=[-1, -1, len(HISTORY_FIELDS)])
        meta.inputs.add(name="history_mask", datatype="FP32", shape=[-1, -1])
        meta.outputs.add(name="score", datatype="FP32", shape=[-1])
        return meta

    async def ModelInfer(self, request, context):
        try:
            rows = decode_infer_request(request, MANIFEST, MANIFEST.output)
        except ServiceError as exc:
            await _refuse(context, exc)
        scores = _scores(rows.features).astype(np.float32)
        return encode_infer_response(request, VERSION, MANIFEST.output, scores)


async def serve(port: int) -> None:
    server = grpc.aio.server()
    risk_scoring_pb2_grpc.add_RiskScoringServicer_to_server(RiskScoring(), server)
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Inference(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"PORT {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(2.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="fake riskserve for load-test tests")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--lenient", action="store_true", help="accept invalid requests")
    args = parser.parse_args()
    LENIENT = args.lenient
    asyncio.run(serve(args.port))
    sys.exit(0)
