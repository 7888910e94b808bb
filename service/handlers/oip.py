"""`inference.GRPCInferenceService`: the Open Inference Protocol, as Triton serves it."""

from __future__ import annotations

import time

import grpc

from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from inference import model_config_pb2 as mc
from service.codec import checked_model_name, decode_infer_request, encode_infer_response
from service.handlers.boundary import (
    deadline_for,
    note_model,
    note_scored,
    note_validated,
    rpc_boundary,
)
from service.registry import ModelRegistry, ModelVersion
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
        budget_s: float,
        server_version: str,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.telemetry = telemetry
        self._registry = registry
        self._budget_s = budget_s
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
            self._registry.get(request.name, request.version)
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
        model = self._registry.get(checked_model_name(request.name, "name"), request.version)
        meta = oip.ModelMetadataResponse.TensorMetadata
        return oip.ModelMetadataResponse(
            name=model.name,
            versions=self._registry.versions(model.name),
            platform=PLATFORM,
            inputs=[meta(name=n, datatype="FP32", shape=s) for n, s in _tensor_shapes(model)],
            outputs=[meta(name=model.manifest.output, datatype="FP32", shape=[-1, 1])],
        )

    @rpc_boundary
    async def ModelConfig(
        self, request: oip.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelConfigResponse:
        model = self._registry.get(checked_model_name(request.name, "name"), request.version)
        config = mc.ModelConfig(
            name=model.name,
            platform=PLATFORM,
            backend="onnxruntime",
            max_batch_size=model.batcher.max_batch_rows,
            input=[
                mc.ModelInput(name=n, data_type=mc.TYPE_FP32, dims=s[1:])
                for n, s in _tensor_shapes(model)
            ],
            output=[mc.ModelOutput(name=model.manifest.output, data_type=mc.TYPE_FP32, dims=[1])],
            dynamic_batching=mc.ModelDynamicBatching(),
            instance_group=[mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)],
        )
        return oip.ModelConfigResponse(config=config)

    @rpc_boundary
    async def ModelInfer(
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        note_model(request.model_name, request.model_version)
        model = self._registry.get(checked_model_name(request.model_name), request.model_version)
        decode_started_ns = time.monotonic_ns()
        rows = decode_infer_request(request, model.manifest)
        note_validated(decode_started_ns)
        scored = await model.batcher.submit(rows, deadline_for(context, self._budget_s))
        note_scored(self.telemetry, model.name, model.version, scored)
        return encode_infer_response(request, model.version, model.manifest.output, scored.scores)
