"""`inference.GRPCInferenceService`: the Open Inference Protocol, as Triton serves it.

A request naming no version is answered by the model's serving version, and metadata, config
and readiness without a version describe that version. An experiment routes an inference
request as a whole by its string parameter ``entity_id`` (a request without one is answered
by the champion, as no entity's).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from inference import model_config_pb2 as mc
from service.api.boundary import (
    after_reply,
    count_refused_message,
    note_model,
    note_scored,
    note_validated,
    rpc_boundary,
    start_rpc_trace,
    trace_scored,
)
from service.api.codec import (
    checked_model_name,
    decode_infer_request,
    decode_infer_together,
    encode_infer_response,
)
from service.api.registration import Malformed
from service.api.stream import (
    DEFAULT_MAX_IN_FLIGHT,
    Arrival,
    MessageContext,
    MessageStreams,
    stream_method,
)
from service.batching.batcher import Scored
from service.batching.budget import Budget
from service.batching.rows import RowBatch
from service.errors import (
    DeadlineMissed,
    InvalidRequest,
    ScoringFailed,
    ServiceError,
    status_for,
)
from service.models.registry import ModelRegistry, ModelVersion
from service.models.routing import RequestRouter
from service.telemetry import RequestTrace, Telemetry
from service.telemetry.tracing import DECISION_DROPPED, SpanContext, Tracing

__all__ = ["InferenceServicer"]

log = logging.getLogger(__name__)

SERVER_NAME = "riskserve"
PLATFORM = "onnxruntime_onnx"


def _tensor_shapes(model: ModelVersion) -> list[tuple[str, list[int]]]:
    """Each input's shape with -1 for variable dims, the batch dimension first."""
    manifest = model.manifest
    shapes = [(manifest.features_input, [-1, manifest.n_features])]
    if manifest.history is not None:
        spec = manifest.history
        shapes += [(spec.input, [-1, -1, len(spec.fields)]), (spec.mask_input, [-1, -1])]
    return shapes


class InferenceServicer(oip_grpc.GRPCInferenceServiceServicer):
    SERVICE_NAME = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name

    def __init__(
        self,
        registry: ModelRegistry,
        budget: Budget,
        server_version: str,
        telemetry: Telemetry | None = None,
        router: RequestRouter | None = None,
        streams: MessageStreams | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.streams = streams or MessageStreams(DEFAULT_MAX_IN_FLIGHT, budget)
        self._registry = registry
        self._router = router or RequestRouter(registry)
        self._budget = budget
        self._server_version = server_version
        self.draining = False

    @rpc_boundary
    async def ServerLive(
        self, request: oip.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=True)

    @rpc_boundary
    async def ServerReady(
        self, request: oip.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerReadyResponse:
        return oip.ServerReadyResponse(ready=self._registry.ready and not self.draining)

    @rpc_boundary
    async def ModelReady(
        self, request: oip.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelReadyResponse:
        try:
            self._router.model(request.name, request.version)
        except Exception:
            return oip.ModelReadyResponse(ready=False)
        return oip.ModelReadyResponse(ready=not self.draining)

    @rpc_boundary
    async def ServerMetadata(
        self, request: oip.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerMetadataResponse:
        return oip.ServerMetadataResponse(
            name=SERVER_NAME, version=self._server_version, extensions=["model_configuration"]
        )

    @rpc_boundary
    async def ModelMetadata(
        self, request: oip.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelMetadataResponse:
        model = self._router.model(checked_model_name(request.name, "name"), request.version)
        meta = oip.ModelMetadataResponse.TensorMetadata
        return oip.ModelMetadataResponse(
            name=model.name,
            versions=self._registry.versions(model.name),
            platform=PLATFORM,
            inputs=[meta(name=n, datatype="FP32", shape=s) for n, s in _tensor_shapes(model)],
            outputs=[meta(name=model.score.served_name, datatype="FP32", shape=[-1, 1])],
        )

    @rpc_boundary
    async def ModelConfig(
        self, request: oip.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelConfigResponse:
        model = self._router.model(checked_model_name(request.name, "name"), request.version)
        config = mc.ModelConfig(
            name=model.name,
            platform=PLATFORM,
            backend="onnxruntime",
            max_batch_size=model.batcher.max_batch_rows,
            input=[
                mc.ModelInput(name=n, data_type=mc.TYPE_FP32, dims=s[1:])
                for n, s in _tensor_shapes(model)
            ],
            output=[mc.ModelOutput(name=model.score.served_name, data_type=mc.TYPE_FP32, dims=[1])],
            dynamic_batching=mc.ModelDynamicBatching(),
            instance_group=[mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)],
        )
        return oip.ModelConfigResponse(config=config)

    @rpc_boundary
    async def ModelInfer(
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        remaining_s = _within_call(_message_budget_s(request), context.time_remaining())
        return await self._infer_one(request, self._budget.deadline(remaining_s))

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[oip.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await self.streams.serve(request_iterator, context, self, _INFER_STREAM)

    async def _infer_one(
        self, request: oip.ModelInferRequest, deadline: float
    ) -> oip.ModelInferResponse:
        """Route, score and record one inference request (unary or streamed).

        The request is routed as a whole by its ``entity_id`` parameter (a string): one version
        answers all its rows, so the response's ``model_version`` is true of every row.
        """
        started = time.perf_counter()
        note_model(request.model_name, request.model_version)
        entity_id = _entity_id(request)
        model, route = self._router.route_one(
            checked_model_name(request.model_name), request.model_version, entity_id
        )
        decode_started_ns = time.monotonic_ns()
        rows = decode_infer_request(request, model.manifest, model.score.served_name)
        note_validated(decode_started_ns)
        scored = await model.batcher.submit(rows, deadline)
        note_scored(self.telemetry, model.name, model.version, scored)
        if route is not None:
            n = rows.rows
            self._router.record(
                model,
                (route,) * n,
                _row_ids(request.id, n),
                (entity_id,) * n,
                rows,
                scored,
                time.perf_counter() - started,
            )
        _require_scores(scored)
        return encode_infer_response(request, model.version, model.score.served_name, scored.scores)


def _require_scores(scored: Scored) -> None:
    """OIP has no fallback decision and no `degraded` flag to answer with: a request the
    batcher degraded (`RISKSERVE_DEGRADE_ON_DEADLINE`) missed its deadline, and a row with no
    finite score failed (`Scored.require_finite`)."""
    if scored.degraded:
        raise DeadlineMissed(_DEGRADED)
    scored.require_finite()


_DEGRADED = "the request cannot be scored within its deadline at this load"


ENTITY_PARAMETER = "entity_id"


def _entity_id(request: oip.ModelInferRequest) -> str:
    """The request's ``entity_id`` parameter; empty when it has none."""
    if ENTITY_PARAMETER not in request.parameters:
        return ""
    parameter = request.parameters[ENTITY_PARAMETER]
    if parameter.WhichOneof("parameter_choice") != "string_param":
        raise InvalidRequest(f"parameters[{ENTITY_PARAMETER!r}]", "must be a string_param")
    return parameter.string_param


def _row_ids(request_id: str, rows: int) -> tuple[str, ...]:
    """One log id per row: the request's id (a fresh one if it has none), ``/i`` per row."""
    base = request_id or uuid.uuid4().hex
    return (base,) if rows == 1 else tuple(f"{base}/{i}" for i in range(rows))


async def _infer_message(
    servicer: InferenceServicer, request: oip.ModelInferRequest, context: MessageContext
) -> oip.ModelStreamInferResponse:
    reply = await servicer._infer_one(request, servicer._budget.deadline(context.time_remaining()))
    return oip.ModelStreamInferResponse(infer_response=reply)


def _infer_error(
    request: oip.ModelInferRequest | Malformed, code: grpc.StatusCode, details: str
) -> oip.ModelStreamInferResponse:
    """Triton's answer to a failed stream request: the error and the request's id."""
    if isinstance(request, Malformed):
        return oip.ModelStreamInferResponse(error_message=details)
    return oip.ModelStreamInferResponse(
        error_message=details,
        infer_response=oip.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )


def _within_call(budget_s: float | None, call_remaining_s: float | None) -> float | None:
    """A request's time, as Triton takes it: its own `timeout` within the call's deadline;
    None where neither is set (the server's budget)."""
    given = [s for s in (budget_s, call_remaining_s) if s is not None]
    return min(given) if given else None


def _message_budget_s(request: oip.ModelInferRequest) -> float | None:
    """Triton's per-request `timeout` parameter, in microseconds, when given."""
    parameters = request.parameters
    if "timeout" in parameters:
        timeout_us = parameters["timeout"].int64_param
        if timeout_us > 0:
            return timeout_us / 1e6
    return None


_STREAM_METHOD = "ModelStreamInfer"


def _infer_together(servicer: InferenceServicer, arrivals: list[Arrival]) -> None:
    """Score the messages read in one turn of the loop together: per model version and
    message timing (`Arrival.timing`), messages alike in their tensors are decoded and checked
    as one array each (`decode_infer_together`; one by one where they differ or a check fails,
    so that an error names its message's field), queued as one job of at most a batch of rows,
    and answered from its scores. A message for an experiment that logs its route (an
    ``entity_id`` parameter, or a model whose experiment logs every request) goes the
    per-message path, which records it."""
    telemetry = servicer.telemetry
    router = servicer._router
    groups: dict[tuple[int, tuple[float | None, float]], tuple[ModelVersion, list[Arrival]]] = {}
    for arrival in arrivals:
        request: oip.ModelInferRequest = arrival.request
        if ENTITY_PARAMETER in request.parameters:
            arrival.alone()
            continue
        try:
            model, route = router.route_one(
                checked_model_name(request.model_name), request.model_version, ""
            )
        except ServiceError as exc:
            _refused(telemetry, arrival, exc)
            continue
        if route is not None:
            arrival.alone()
            continue
        groups.setdefault((id(model), arrival.timing), (model, []))[1].append(arrival)
    for model, alike in groups.values():
        per_job = max(1, model.batcher.max_batch_rows // _rows_named(alike[0].request, model))
        for at in range(0, len(alike), per_job):
            chunk = alike[at : at + per_job]
            try:
                _queue(model, chunk, telemetry)
            except Exception:  # these messages only: the others' jobs go on
                log.exception("queueing %d stream messages failed", len(chunk))
                for arrival in chunk:
                    arrival.fail(grpc.StatusCode.INTERNAL, "internal error")


def _queue(model: ModelVersion, chunk: list[Arrival], telemetry: Telemetry | None) -> None:
    """Decode messages for one model version, and queue them as one job."""
    job = _StreamJob(model, telemetry)
    rows = decode_infer_together(
        [a.request for a in chunk], model.manifest, model.score.served_name
    )
    if rows is not None:
        job.add_part(rows)
        for arrival in chunk:  # alike: each holds an equal share of the rows
            job.add(arrival, rows.rows // len(chunk))
    else:
        for arrival in chunk:
            try:
                part = decode_infer_request(
                    arrival.request, model.manifest, model.score.served_name
                )
            except ServiceError as exc:
                _refused(telemetry, arrival, exc)
                continue
            job.add_part(part)
            job.add(arrival, part.rows)
    if job.arrivals:
        job.start()


def _rows_named(request: oip.ModelInferRequest, model: ModelVersion) -> int:
    """The rows a request's features tensor says it holds (at least 1): what sizes a job."""
    features = model.manifest.features_input
    for tensor in request.inputs:
        if tensor.name == features and tensor.shape:
            return max(int(tensor.shape[0]), 1)
    return 1


def _refused(telemetry: Telemetry | None, arrival: Arrival, exc: ServiceError) -> None:
    """Answer a message that could not be scored, and trace and count it."""
    code = status_for(exc)
    arrival.fail(code, str(exc))
    if telemetry is not None:
        request: oip.ModelInferRequest = arrival.request
        model = (request.model_name, request.model_version)
        count_refused_message(
            telemetry,
            InferenceServicer.SERVICE_NAME,
            _STREAM_METHOD,
            arrival.metadata,
            arrival.received_ns,
            code,
            model,
        )


def _message_trace(tracing: Tracing, arrival: Arrival) -> RequestTrace:
    """A stream message's trace, from when its stream read it."""
    return start_rpc_trace(
        tracing,
        InferenceServicer.SERVICE_NAME,
        _STREAM_METHOD,
        arrival.metadata,
        arrival.received_ns,
    )


class _StreamJob:
    """Stream messages for one model version, queued as one job and answered from its scores."""

    __slots__ = ("arrivals", "deadline", "model", "parts", "rows", "telemetry", "traces", "tracing")

    def __init__(self, model: ModelVersion, telemetry: Telemetry | None) -> None:
        self.model = model
        self.telemetry = telemetry
        self.tracing = telemetry.tracing if telemetry is not None else None
        self.arrivals: list[Arrival] = []
        self.rows: list[int] = []  # each message's rows, in order
        self.parts: list[RowBatch] = []  # the rows of all, in the same order
        self.traces: list[RequestTrace | None] = []
        self.deadline = float("inf")

    def add_part(self, rows: RowBatch) -> None:
        self.parts.append(rows)

    def add(self, arrival: Arrival, rows: int) -> None:
        self.arrivals.append(arrival)
        self.rows.append(rows)
        self.deadline = min(self.deadline, arrival.deadline)
        trace = None
        if self.tracing is not None:
            trace = _message_trace(self.tracing, arrival)
        self.traces.append(trace)

    def start(self) -> None:
        task = asyncio.get_running_loop().create_task(
            self.model.batcher.submit(self.parts, self.deadline, len(self.arrivals))
        )
        task.add_done_callback(self._scored)

    def _scored(self, task: asyncio.Task[Scored]) -> None:
        model = self.model
        try:
            scored = task.result()
        except ServiceError as exc:
            self._failed(status_for(exc), str(exc))
            return
        except asyncio.CancelledError:
            self._failed(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
            return
        except Exception:
            log.exception("scoring %d stream messages failed", len(self.arrivals))
            self._failed(grpc.StatusCode.INTERNAL, "internal error")
            return
        if scored.degraded:  # no fallback decision to answer with (`_require_scores`)
            self._failed(grpc.StatusCode.DEADLINE_EXCEEDED, _DEGRADED)
            return
        batch = scored.batch_trace
        if batch is not None:  # the batch's span links each message's, as a request's would
            batch.links.extend((t.trace_id, t.span_id) for t in self.traces if t is not None)
        served = model.score.served_name
        scores = scored.scores
        start = 0
        unscored = []
        checked = not scored.finite()  # some message's rows have no score: find whose
        for k, (arrival, rows, trace) in enumerate(
            zip(self.arrivals, self.rows, self.traces, strict=True)
        ):
            end = start + rows
            if checked:
                try:
                    scored.require_finite(start, end)
                except ScoringFailed as exc:  # this message's rows only
                    arrival.fail(status_for(exc), str(exc))
                    unscored.append(k)
                    start = end
                    continue
            reply = encode_infer_response(arrival.request, model.version, served, scores[start:end])
            arrival.answer(oip.ModelStreamInferResponse(infer_response=reply))
            start = end
            if trace is not None:
                trace_scored(trace, model.name, model.version, scored)
        if unscored:
            self._record(grpc.StatusCode.INTERNAL, scored.engine, self._split_off(unscored))
        self._record(grpc.StatusCode.OK, scored.engine)

    def _failed(self, code: grpc.StatusCode, details: str) -> None:
        for arrival in self.arrivals:
            arrival.fail(code, details)
        self._record(code, "")

    def _split_off(self, picked: list[int]) -> tuple[list[Arrival], list[RequestTrace | None]]:
        """The messages at `picked`, taken out of the job's (to be counted on their own)."""
        taken_set = set(picked)
        keep = [k for k in range(len(self.arrivals)) if k not in taken_set]
        taken = [self.arrivals[k] for k in picked], [self.traces[k] for k in picked]
        self.arrivals = [self.arrivals[k] for k in keep]
        self.traces = [self.traces[k] for k in keep]
        return taken

    def _record(
        self,
        code: grpc.StatusCode,
        engine: str,
        messages: tuple[list[Arrival], list[RequestTrace | None]] | None = None,
    ) -> None:
        """End the answered messages' traces (the job's, or `messages`) and count them, all
        with status `code`."""
        arrivals, traces = messages if messages is not None else (self.arrivals, self.traces)
        if not arrivals:
            return
        now_ns = time.monotonic_ns()
        tracing = self.tracing
        durations = [(now_ns - arrival.received_ns) / 1e9 for arrival in arrivals]
        kept = [_ended(tracing, trace, code) for trace in traces]
        if self.telemetry is not None:
            model = self.model
            self.telemetry.metrics.observe_requests(
                model.name, model.version, engine, code.name, durations, kept, _STREAM_METHOD
            )


def _ended(
    tracing: Tracing | None, trace: RequestTrace | None, code: grpc.StatusCode
) -> SpanContext | None:
    """End a message's trace with its status; its span where the trace is kept."""
    if tracing is None or trace is None:
        return None
    details = "" if code is grpc.StatusCode.OK else code.name
    if tracing.end_request(trace, code.value[0], details, after_reply) == DECISION_DROPPED:
        return None
    return trace.context


_INFER_STREAM = stream_method(
    _STREAM_METHOD, _infer_message, _infer_error, _message_budget_s, _infer_together
)
