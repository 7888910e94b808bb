"""`riskscoring.v1.RiskScoring`: Score, ScoreBatch, GetModelInfo."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator

import grpc

from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.batcher import Scored
from service.codec import DECISIONS, decode_score_batch, decode_score_request
from service.experiments import Experiments
from service.handlers.boundary import (
    Malformed,
    deadline_for,
    note_model,
    note_scored,
    note_validated,
    rpc_boundary,
)
from service.handlers.stream import (
    DEFAULT_MAX_IN_FLIGHT,
    MessageContext,
    MessageStreams,
    stream_method,
)
from service.registry import ModelRegistry, ModelVersion
from service.telemetry import Telemetry

__all__ = ["RiskScoringServicer"]


class RiskScoringServicer(pb_grpc.RiskScoringServicer):
    SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RiskScoring"].full_name

    def __init__(
        self,
        registry: ModelRegistry,
        default_model: str,
        budget_s: float,
        experiments: Experiments | None = None,
        telemetry: Telemetry | None = None,
        streams: MessageStreams | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.streams = streams or MessageStreams(DEFAULT_MAX_IN_FLIGHT, budget_s)
        self._registry = registry
        self._default_model = default_model
        self._budget_s = budget_s
        self._experiments = experiments

    def _model(self, name: str, version: str) -> ModelVersion:
        return self._registry.get(name or self._default_model, version)

    @rpc_boundary
    async def Score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse:
        return await self._score_one(request, deadline_for(context, self._budget_s))

    async def _score_one(self, request: pb.ScoreRequest, deadline: float) -> pb.ScoreResponse:
        """Score one request by monotonic time `deadline`: Score's path, and each message's of
        ScoreStream."""
        started = time.perf_counter()
        name = request.model or self._default_model
        version = request.model_version
        note_model(name, version)
        route = None
        if self._experiments is not None and not version:
            route = self._experiments.route(name, request.entity_id)
            version = route.serving_version or ""
        model = self._model(name, version)
        decode_started_ns = time.monotonic_ns()
        rows = decode_score_request(request, model.manifest)
        note_validated(decode_started_ns)
        scored = await model.batcher.submit(rows, deadline)
        reply = _response(request.request_id, model, scored, 0, started)
        note_scored(
            self.telemetry, model.name, model.version, scored, pb.Decision.Name(reply.decision)
        )
        if route is not None:
            self._experiments.record(  # type: ignore[union-attr]
                route,
                model,
                (request.request_id,),
                (request.entity_id,),
                rows,
                scored,
                time.perf_counter() - started,
            )
        return reply

    async def ScoreStream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await self.streams.serve(request_iterator, context, self, _SCORE_STREAM)

    @rpc_boundary
    async def ScoreBatch(
        self, request: pb.ScoreBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreBatchResponse:
        started = time.perf_counter()
        note_model(request.model or self._default_model, request.model_version)
        model = self._model(request.model, request.model_version)
        decode_started_ns = time.monotonic_ns()
        rows = decode_score_batch(request, model.manifest)
        note_validated(decode_started_ns)
        scored = await model.batcher.submit(rows, deadline_for(context, self._budget_s))
        note_scored(self.telemetry, model.name, model.version, scored)
        if self._experiments is not None and not request.model_version:
            # A batch is served by the champion as a whole; shadow mode copies all of it.
            route = self._experiments.route(model.name, request.requests[0].entity_id)
            if route.mode == "shadow" and route.serving_version in (None, model.version):
                self._experiments.record(
                    route,
                    model,
                    tuple(r.request_id for r in request.requests),
                    tuple(r.entity_id for r in request.requests),
                    rows,
                    scored,
                    time.perf_counter() - started,
                )
        return pb.ScoreBatchResponse(
            responses=[
                _response(item.request_id, model, scored, i, started)
                for i, item in enumerate(request.requests)
            ]
        )

    @rpc_boundary
    async def GetModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        model = self._model(request.model, request.model_version)
        manifest = model.manifest
        history = manifest.history
        health = model.pool.health
        engines = []
        for engine in model.engines():
            lengths = [
                s.dims[1].max_value
                for p in engine.profiles
                for s in p.inputs
                if history is not None and s.name == history.input and len(s.dims) > 1
            ]
            max_length = 0 if not lengths or None in lengths else max(v or 0 for v in lengths)
            engines.append(
                pb.EngineInfo(
                    name=engine.name,
                    kind=engine.kind,
                    precision=engine.precision,
                    max_batch_size=engine.max_batch_size or 0,
                    max_history_length=max_length,
                    healthy=health[engine.name].healthy if engine.name in health else True,
                )
            )
        return pb.ModelInfo(
            model=manifest.name,
            model_version=manifest.version,
            versions=self._registry.versions(manifest.name),
            feature_names=manifest.features,
            history_fields=history.fields if history else (),
            max_history_length=history.max_length if history else 0,
            max_batch_size=manifest.max_batch_size,
            nan_policy=manifest.nan_policy,
            thresholds=pb.Thresholds(
                review=manifest.thresholds.review, decline=manifest.thresholds.decline
            ),
            engines=engines,
            description=manifest.description,
        )


async def _score_message(
    servicer: RiskScoringServicer, request: pb.ScoreRequest, context: MessageContext
) -> pb.ScoreResponse:
    return await servicer._score_one(request, deadline_for(context, servicer._budget_s))


def _score_error(
    request: pb.ScoreRequest | Malformed, code: grpc.StatusCode, details: str
) -> pb.ScoreResponse:
    request_id = "" if isinstance(request, Malformed) else request.request_id
    return pb.ScoreResponse(
        request_id=request_id, status=pb.Status(code=code.value[0], message=details)
    )


def _message_budget_s(request: pb.ScoreRequest) -> float | None:
    timeout_us = request.timeout_us
    return timeout_us / 1e6 if timeout_us else None


def _response(
    request_id: str, model: ModelVersion, scored: Scored, row: int, started: float
) -> pb.ScoreResponse:
    manifest = model.manifest
    score = float(scored.scores[row])
    engine, fallback_reason = scored.row_engine(row)
    decision: str
    if scored.degraded or math.isnan(score):
        decision = manifest.fallback_decision
        score = 0.0
    else:
        decision = manifest.thresholds.decide(score)
    return pb.ScoreResponse(
        request_id=request_id,
        score=score,
        decision=DECISIONS[decision],
        model=manifest.name,
        model_version=manifest.version,
        engine=engine,
        fallback_reason=fallback_reason,
        degraded=scored.degraded,
        timings=pb.Timings(
            total_us=int((time.perf_counter() - started) * 1e6),
            queue_us=int(scored.queue_s * 1e6),
            engine_us=int(scored.engine_s * 1e6),
            batch_size=scored.batch_rows,
        ),
    )


_SCORE_STREAM = stream_method("ScoreStream", _score_message, _score_error, _message_budget_s)
