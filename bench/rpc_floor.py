"""Server CPU per sequential request: a bare grpc.aio servicer against riskserve.

The bare servicer answers OIP ModelInfer (and each request of ModelStreamInfer) with zero
scores of the shape riskserve returns, computing nothing, so its figure is the floor that gRPC's
Python server costs on this machine; riskserve's excess over it is its own work. It also
describes the demo model as riskserve does (ModelMetadata, ModelConfig), so perf_analyzer can
drive it too (`bench.latency_split --floor`).

    .venv/bin/python -m bench.rpc_floor --requests 300
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc
import psutil

from bench.model_io import ModelIO, make_request_arrays, read_model_io
from bench.oip import build_infer_request
from bench.servers import ServerProcess, ServerSpec, free_port
from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from inference import model_config_pb2 as mc

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "fraud-demo" / "1" / "model.onnx"


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
        cwd=REPO,
    )


async def _serve_echo(port: int) -> None:
    server = grpc.aio.server()
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(_Echo(read_model_io(MODEL)), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _measure(pid: int, target: str, requests: int) -> tuple[float, float]:
    io = read_model_io(MODEL)
    request = build_infer_request("fraud-demo", make_request_arrays(io, 32, seed=1), io.output)
    process = psutil.Process(pid)
    with grpc.insecure_channel(target) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(100):
            stub.ModelInfer(request, timeout=5)
        cpu_before = sum(process.cpu_times()[:2])
        started = time.perf_counter()
        for _ in range(requests):
            stub.ModelInfer(request, timeout=5)
        wall_s = time.perf_counter() - started
        cpu_s = sum(process.cpu_times()[:2]) - cpu_before
    return cpu_s / requests * 1e3, wall_s / requests * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args(argv)
    rows = []
    specs = [echo_spec(free_port())]
    for tracing in ("true", "false"):
        port = free_port()
        specs.append(
            ServerSpec(
                f"riskserve tracing={tracing}",
                (str(REPO / ".venv" / "bin" / "riskserve"), "serve", "--port", str(port)),
                port,
                "fraud-demo",
                env={
                    "RISKSERVE_TRACING": tracing,
                    "RISKSERVE_METRICS_PORT": "none",
                    "RISKSERVE_TRACE_FILE": "none",
                    "RISKSERVE_ONNX_VARIANTS": "false",
                },
                cwd=REPO,
            )
        )
    results = REPO / "bench" / "results"
    for spec in specs:
        log = results / f"rpc_floor_{spec.grpc_port}.log"
        with ServerProcess(spec, log) as server:
            assert server._process is not None
            cpu_ms, wall_ms = _measure(server._process.pid, server.target, args.requests)
        rows.append((spec.name, cpu_ms, wall_ms))
    print("server | server CPU ms/req | wall ms/req")
    for name, cpu_ms, wall_ms in rows:
        print(f"{name} | {cpu_ms:.2f} | {wall_ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
