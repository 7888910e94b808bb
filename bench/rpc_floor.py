"""Server CPU per sequential request: a bare grpc.aio servicer against riskserve.

The bare servicer answers OIP ModelInfer with an empty response, so its figure is the floor
that gRPC's Python server costs on this machine; riskserve's excess over it is its own work.

    .venv/bin/python -m bench.rpc_floor --requests 300
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc
import psutil

from bench.model_io import make_request_arrays, read_model_io
from bench.oip import build_infer_request
from bench.servers import ServerProcess, ServerSpec, free_port
from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "fraud-demo" / "1" / "model.onnx"


class _Echo(oip_grpc.GRPCInferenceServiceServicer):
    async def ServerReady(self, request, context):
        return oip.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return oip.ModelReadyResponse(ready=True)

    async def ModelInfer(self, request, context):
        return oip.ModelInferResponse(model_name=request.model_name)


async def _serve_echo(port: int) -> None:
    server = grpc.aio.server()
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(_Echo(), server)
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
    echo_port = free_port()
    echo = ServerSpec(
        "grpc.aio echo",
        (
            sys.executable,
            "-c",
            f"import asyncio, bench.rpc_floor as f; asyncio.run(f._serve_echo({echo_port}))",
        ),
        echo_port,
        "fraud-demo",
        cwd=REPO,
    )
    specs = [echo]
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
