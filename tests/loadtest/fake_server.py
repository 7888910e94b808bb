"""A stand-in riskserve for testing the load test itself: same services, trivial scoring.

    python tests/loadtest/fake_server.py [--port P]   # prints "PORT <n>" once listening

It validates like the real server is specified to (unknown feature names and NaN are
INVALID_ARGUMENT; histories longer than 64 rows are "served by the fallback"), so a locust
run against it exercises every task and the expected-invalid accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inference import grpc_service_pb2, grpc_service_pb2_grpc
from riskscoring.v1 import risk_scoring_pb2, risk_scoring_pb2_grpc

MODEL = "fake-model"
VERSION = "1"
FEATURES = (*(f"f{i:02d}" for i in range(30)), "amount", "is_foreign")
HISTORY_FIELDS = ("amount", "seconds_since", "merchant_risk", "is_online")
PRIMARY_MAX_ROWS = 64
MAX_ROWS = 256


class _Invalid(Exception):
    pass


LENIENT = False  # --lenient: accept unknown features (a server bug the load test must catch)


def _score(request: risk_scoring_pb2.ScoreRequest) -> risk_scoring_pb2.ScoreResponse:
    unknown = set(request.features) - set(FEATURES)
    if unknown and not LENIENT:
        raise _Invalid(f"unknown features: {sorted(unknown)}")
    values = [request.features.get(name, 0.0) for name in FEATURES]
    if not LENIENT and any(math.isnan(v) or math.isinf(v) for v in values):
        raise _Invalid("NaN or Inf in features")
    if len(request.history) > MAX_ROWS:
        raise _Invalid("history too long")
    if any(len(row.values) != len(HISTORY_FIELDS) for row in request.history):
        raise _Invalid("history row width")
    score = 1.0 / (1.0 + math.exp(-math.tanh(sum(values) / 1000.0)))
    long_history = len(request.history) > PRIMARY_MAX_ROWS
    return risk_scoring_pb2.ScoreResponse(
        request_id=request.request_id,
        score=score,
        decision=risk_scoring_pb2.DECLINE if score > 0.7 else risk_scoring_pb2.APPROVE,
        model=MODEL,
        model_version=VERSION,
        engine="fake-fallback" if long_history else "fake-primary",
        fallback_reason="history_length" if long_history else "",
    )


class RiskScoring(risk_scoring_pb2_grpc.RiskScoringServicer):
    async def Score(self, request, context):
        try:
            return _score(request)
        except _Invalid as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def ScoreBatch(self, request, context):
        try:
            return risk_scoring_pb2.ScoreBatchResponse(
                responses=[_score(r) for r in request.requests]
            )
        except _Invalid as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def GetModelInfo(self, request, context):
        return risk_scoring_pb2.ModelInfo(
            model=MODEL,
            model_version=VERSION,
            versions=[VERSION],
            feature_names=FEATURES,
            history_fields=HISTORY_FIELDS,
            max_history_length=MAX_ROWS,
            max_batch_size=64,
            nan_policy="reject",
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
        if len(request.raw_input_contents) != len(request.inputs):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "raw contents per input")
        features = np.frombuffer(request.raw_input_contents[0], dtype="<f4")
        batch = int(request.inputs[0].shape[0])
        scores = np.full(batch, 1.0 / (1.0 + math.exp(-float(features.sum()) / 1e6)), "<f4")
        response = grpc_service_pb2.ModelInferResponse(
            model_name=MODEL, model_version=VERSION, id=request.id
        )
        response.outputs.add(name="score", datatype="FP32", shape=[batch])
        response.raw_output_contents.append(scores.tobytes())
        return response


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
