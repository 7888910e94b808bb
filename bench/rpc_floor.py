"""The `grpc-floor` server: a grpc.aio servicer that answers OIP and does no work.

It answers ModelInfer (and each request of ModelStreamInfer) with zero scores of the shape
riskserve returns, computing nothing, so what it costs is the floor that gRPC's Python server
costs on the machine; riskserve's excess over it is its own work. It describes the demo model
as riskserve does (ModelMetadata, ModelConfig), so perf_analyzer can drive it too.
`bench.compare` and `bench.streaming` start it as `grpc-floor`; alone:

    .venv/bin/python -m bench.rpc_floor --grpc-port 8011
"""

from __future__ import annotations

import argparse
import sys

import grpc

from bench.model_io import DEMO_MODEL_PATH, REPO_ROOT, ModelIO, read_model_io
from bench.servers import ServerSpec, serve_alone
from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from inference import model_config_pb2 as mc


class _Echo(oip_grpc.GRPCInferenceServiceServicer):
    """Does no work; describes the demo model as riskserve does, so perf_analyzer can drive it."""

    def __init__(self, io: ModelIO) -> None:
        self._io = io

    async def ServerReady(self, request, context):
        return oip.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return oip.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request, context):
        return oip.ServerMetadataResponse(name="grpc.aio echo", version="0")

    async def ModelMetadata(self, request, context):
        meta = oip.ModelMetadataResponse.TensorMetadata
        return oip.ModelMetadataResponse(
            name=request.name,
            versions=["1"],
            inputs=[
                meta(name=n, datatype="FP32", shape=[-1, *dims]) for n, dims in _dims(self._io)
            ],
            outputs=[meta(name=self._io.output, datatype="FP32", shape=[-1, 1])],
        )

    async def ModelConfig(self, request, context):
        config = mc.ModelConfig(
            name=request.name,
            max_batch_size=64,
            input=[
                mc.ModelInput(name=n, data_type=mc.TYPE_FP32, dims=dims)
                for n, dims in _dims(self._io)
            ],
            output=[mc.ModelOutput(name=self._io.output, data_type=mc.TYPE_FP32, dims=[1])],
        )
        return oip.ModelConfigResponse(config=config)

    async def ModelInfer(self, request, context):
        return self._zeros(request)

    async def ModelStreamInfer(self, request_iterator, context):
        # One answer per request as it is read: the least a Python stream can cost.
        async for request in request_iterator:
            yield oip.ModelStreamInferResponse(infer_response=self._zeros(request))

    def _zeros(self, request):
        # Zero scores of riskserve's output shape: perf_analyzer counts a reply without them
        # as no reply.
        rows = request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1
        response = oip.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name=self._io.output, datatype="FP32", shape=[rows, 1])
        response.raw_output_contents.append(bytes(4 * rows))
        return response


def _dims(io: ModelIO) -> list[tuple[str, list[int]]]:
    """Each input's shape after the batch dimension (-1: any length), as riskserve gives it."""
    return [
        (io.features_input, [io.n_features]),
        (io.history_input, [-1, io.n_history_fields]),
        (io.mask_input, [-1]),
    ]


def echo_spec(port: int) -> ServerSpec:
    """The do-nothing grpc.aio server as a process on `port`."""
    return ServerSpec(
        "grpc.aio echo",
        (
            sys.executable,
            "-c",
            f"import asyncio, bench.rpc_floor as f; asyncio.run(f._serve_echo({port}))",
        ),
        port,
        "fraud-demo",
        cwd=REPO_ROOT,
    )


async def _serve_echo(port: int) -> None:
    server = grpc.aio.server()
    servicer = _Echo(read_model_io(DEMO_MODEL_PATH))
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-port", type=int, default=8011, help="listens on 127.0.0.1")
    parser.add_argument("--serve-s", type=float, default=600.0, help="stop after this long")
    args = parser.parse_args(argv)
    log_path = REPO_ROOT / "bench" / "results" / "logs" / "grpc-floor.log"
    return serve_alone(echo_spec(args.grpc_port), log_path, args.serve_s)


if __name__ == "__main__":
    sys.exit(main())
