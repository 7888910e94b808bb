"""`riskscoring.v1.RiskScoring`: Score, ScoreBatch, GetModelInfo."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.api.boundary import (
    note_model,
    note_scored,
    note_validated,
    rpc_boundary,
)
from service.api.codec import DECISIONS, decode_score_batch, decode_score_request
from service.api.registration import Malformed
from service.api.stream import (
    DEFAULT_MAX_IN_FLIGHT,
    MessageContext,
    MessageStreams,
    stream_method,
)
from service.batching.batcher import Scored
from service.batching.budget import Budget
from service.batching.rows import RowBatch
from service.errors import InvalidRequest
from service.explanations import occlusion as explain
from service.models.experiments import Experiments
from service.models.registry import ModelRegistry, ModelVersion
from service.models.routing import RequestRouter
from service.telemetry import Telemetry

__all__ = ["RiskScoringServicer"]


class RiskScoringServicer(pb_grpc.RiskScoringServicer):
    SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RiskScoring"].full_name

    def __init__(
        self,
        registry: ModelRegistry,
        default_model: str,
        budget: Budget,
        experiments: Experiments | None = None,
        telemetry: Telemetry | None = None,
        router: RequestRouter | None = None,
        explain_when: explain.ExplainWhen = "adverse",
        streams: MessageStreams | None = None,
    ) -> None:
        self._explain_when: explain.ExplainWhen = explain_when
        self.telemetry = telemetry
        self.streams = streams or MessageStreams(DEFAULT_MAX_IN_FLIGHT, budget)
        self._registry = registry
        self._default_model = default_model
        self._budget = budget
        self._router = router or RequestRouter(registry, experiments)

    @rpc_boundary
    async def Score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse:
        return await self._score_one(request, self._budget.deadline(context.time_remaining()))

    async def _score_one(self, request: pb.ScoreRequest, deadline: float) -> pb.ScoreResponse:
        """Route, score and record one request: Score's path, and each message's of ScoreStream;
        `deadline` is monotonic seconds."""
        started = time.perf_counter()
        name = request.model or self._default_model
        note_model(name, request.model_version)
        model, route = self._router.route_one(name, request.model_version, request.entity_id)
        decode_started_ns = time.monotonic_ns()
        rows = decode_score_request(request, model.manifest)
        note_validated(decode_started_ns)
        # Without explain_top_k this is the plain submit of the request's row; with it, the
        # rows that explain it follow, and a reload retiring the version waits for them.
        with model.held():
            scored, reasons = await explain.score_explained(
                model.batcher.submit, model.manifest, request, rows, deadline, self._explain_when
            )
        scored.require_finite()
        reply = _response(request.request_id, model, scored, 0, started)
        explain.encode_reasons(reply, reasons)
        note_scored(
            self.telemetry, model.name, model.version, scored, pb.Decision.Name(reply.decision)
        )
        if route is not None:
            self._router.record(
                model,
                (route,),
                (request.request_id or uuid.uuid4().hex,),  # an id the report can pair by
                (request.entity_id,),
                rows,
                scored,
                time.perf_counter() - started,
                explain.explained(request, self._explain_when, reasons),
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
        """Each row is routed by its own entity; rows of different versions score concurrently,
        one batcher submit per version, and are answered in request order."""
        started = time.perf_counter()
        name = request.model or self._default_model
        note_model(name, request.model_version)
        items = request.requests
        if not items:
            raise InvalidRequest("requests", "is empty")
        # Refused before any pass over the items: a few megabytes of empty items are millions,
        # and each pass would hold the event loop for every other call.
        most = self._router.most_rows(name, request.model_version)
        if len(items) > most:
            raise InvalidRequest("requests", f"{len(items)} rows exceed the limit of {most}")
        explain.check_batch(request)
        assignments = self._router.route_rows(
            name, request.model_version, [item.entity_id for item in items]
        )
        deadline = self._budget.deadline(context.time_remaining())
        decode_started_ns = time.monotonic_ns()
        # Each version decodes and checks the rows it answers, by its own manifest.
        groups = [decode_score_batch(request, a.model.manifest, a.rows) for a in assignments]
        note_validated(decode_started_ns)
        if len(groups) == 1:
            outcomes = [await assignments[0].model.batcher.submit(groups[0], deadline)]
        else:
            outcomes = await asyncio.gather(
                *(
                    a.model.batcher.submit(g, deadline)
                    for a, g in zip(assignments, groups, strict=True)
                )
            )
        replies: list[pb.ScoreResponse | None] = [None] * len(items)
        for assignment, group, scored in zip(assignments, groups, outcomes, strict=True):
            model = assignment.model
            note_scored(self.telemetry, model.name, model.version, scored)
            scored.require_finite()
            for k, i in enumerate(assignment.rows):
                replies[i] = _response(items[i].request_id, model, scored, k, started)
            if not assignment.routed:
                continue
            self._router.record(
                model,
                assignment.routes,
                [items[i].request_id or uuid.uuid4().hex for i in assignment.rows],
                [items[i].entity_id for i in assignment.rows],
                RowBatch.concat(group, model.manifest.history),  # the shadow copy's rows
                scored,
                time.perf_counter() - started,
            )
        return pb.ScoreBatchResponse(responses=replies)

    @rpc_boundary
    async def GetModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        model = self._router.model(request.model or self._default_model, request.model_version)
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
            max_batch_size=model.batcher.max_batch_rows,
            max_score_batch_requests=manifest.max_batch_size,
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
    return await servicer._score_one(request, servicer._budget.deadline(context.time_remaining()))


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
    if scored.degraded:
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
