"""A tiny grpc.aio server whose one unary method sleeps, aborts, raises or adds a child span."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import grpc
from opentelemetry import trace

from service.telemetry import Telemetry

SERVICE = "test.Echo"
METHOD = "Call"


def _behaviour(telemetry: Telemetry):
    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        started_s = time.monotonic()
        command, _, argument = request.decode().partition(":")
        status = "OK"
        try:
            if command == "sleep":
                with telemetry.tracer.start_as_current_span("work") as child:
                    child.add_event("sleeping", {"ms": float(argument)})
                    await asyncio.sleep(float(argument) / 1e3)
            elif command == "abort":
                status = "NOT_FOUND"
                await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")
            elif command == "raise":
                status = "UNKNOWN"
                raise RuntimeError("boom")
            trace.get_current_span().set_attribute("test.command", command)
            return b"ok"
        finally:
            telemetry.metrics.observe_request(
                "m", "1", "fake", status, time.monotonic() - started_s
            )

    return call


@asynccontextmanager
async def echo_server(telemetry: Telemetry) -> AsyncIterator[grpc.aio.UnaryUnaryMultiCallable]:
    """Serve on 127.0.0.1:0 with the tracing interceptor; yield a client stub for the method."""
    server = grpc.aio.server(interceptors=[telemetry.interceptor()])
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(_behaviour(telemetry))}
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
