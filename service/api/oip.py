"""`inference.GRPCInferenceService`: the Open Inference Protocol, as Triton serves it.

A request naming no version is answered by the model's serving version, and metadata, config
and readiness without a version describe that version. An experiment routes an inference
request as a whole by its string parameter ``entity_id`` (a request without one is answered
by the champion, as no entity's).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import grpc

from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from inference import model_config_pb2 as mc
from service.api.boundary import (
    note_model,
    note_scored,
    note_validated,
    rpc_boundary,
)
from service.api.codec import checked_model_name, decode_infer_request, encode_infer_response
from service.api.registration import Malformed
from service.api.stream import (
    DEFAULT_MAX_IN_FLIGHT,
    MessageContext,
    MessageStreams,
    stream_method,
)
from service.batching.budget import Budget
from service.errors import InvalidRequest
from service.models.registry import ModelRegistry, ModelVersion
from service.models.routing import RequestRouter
from service.telemetry import Telemetry

__all__ = ["InferenceServicer"]

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
        return await self._infer_one(request, self._budget.deadline(context.time_remaining()))

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
        return encode_infer_response(request, model.version, model.score.served_name, scored.scores)


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


def _message_budget_s(request: oip.ModelInferRequest) -> float | None:
    """Triton's per-request `timeout` parameter, in microseconds, when given."""
    parameters = request.parameters
    if "timeout" in parameters:
        timeout_us = parameters["timeout"].int64_param
        if timeout_us > 0:
            return timeout_us / 1e6
    return None


_INFER_STREAM = stream_method("ModelStreamInfer", _infer_message, _infer_error, _message_budget_s)
