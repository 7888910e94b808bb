"""A tiny grpc.aio server whose one unary method sleeps, aborts, raises or fails cleanly.

It goes through the same `rpc_boundary` as riskserve's own servicers, so its calls are traced,
tail-sampled and counted exactly as theirs are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import grpc

from service.api.boundary import note_model, rpc_boundary
from service.errors import ModelNotFound
from service.telemetry import Telemetry, current_request_trace

SERVICE = "test.Echo"
METHOD = "Call"


class EchoServicer:
    SERVICE_NAME = SERVICE

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    @rpc_boundary
    async def Call(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        command, _, argument = request.decode().partition(":")
        note_model("m", "1")
        trace = current_request_trace()
        if command == "sleep":
            started_ns = time.monotonic_ns()
            await asyncio.sleep(float(argument) / 1e3)
            if trace is not None:
                trace.add_stage("work", started_ns, time.monotonic_ns(), {"ms": float(argument)})
        elif command == "abort":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")
        elif command == "missing":
            raise ModelNotFound("no model 'x'")
        elif command == "raise":
            raise RuntimeError("boom")
        if trace is not None:
            trace.attributes["test.command"] = command
        return b"ok"


@asynccontextmanager
async def echo_server(telemetry: Telemetry) -> AsyncIterator[grpc.aio.UnaryUnaryMultiCallable]:
    """Serve on 127.0.0.1:0; yield a client stub for the method."""
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(EchoServicer(telemetry).Call)}
    )
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel.unary_unary(f"/{SERVICE}/{METHOD}")
    finally:
        await server.stop(None)


async def call(
    stub: grpc.aio.UnaryUnaryMultiCallable,
    request: bytes,
    metadata: Sequence[tuple[str, str]] = (),
) -> grpc.StatusCode:
    try:
        await stub(request, metadata=tuple(metadata), timeout=5)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK
