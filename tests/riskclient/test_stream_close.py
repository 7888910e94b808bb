"""Closing a shared stream whose server stopped answering ends within its grace: the requests
still unanswered fail with StreamClosed, and close() returns instead of waiting for good."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
import pytest
from liveserver import riskscoring_server
from waiting import until, wait_until

from riskclient import (
    AsyncRiskClient,
    AsyncScoreStream,
    Connection,
    RiskClient,
    ScoreStream,
    StreamClosed,
)
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc


class _Silent(pb_grpc.RiskScoringServicer):
    """Opens each stream and reads its requests, and never answers one."""

    def __init__(self) -> None:
        self.read: list[str] = []

    async def ScoreStream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ScoreResponse]:
        await context.send_initial_metadata(())
        async for request in request_iterator:
            self.read.append(request.request_id)
        await asyncio.Event().wait()  # the caller half-closed; still no answer
        yield pb.ScoreResponse()


async def _silent_server() -> tuple[grpc.aio.Server, _Silent, str]:
    servicer = _Silent()
    server, target = await riskscoring_server(servicer)
    return server, servicer, target


def test_close_fails_what_a_silent_server_never_answered_after_its_grace():
    async def run() -> tuple[BaseException | None, list[str]]:
        server, servicer, target = await _silent_server()
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                stream = AsyncScoreStream(channel)  # no timeout: the server's budget applies
                waiting = asyncio.ensure_future(stream.score(pb.ScoreRequest(request_id="r1")))
                await until(lambda: servicer.read == ["r1"])
                await stream.close(grace_s=0.05)
                return waiting.exception(), servicer.read
        finally:
            await server.stop(None)

    failed, read = asyncio.run(run())
    assert isinstance(failed, StreamClosed), failed
    assert read == ["r1"]


def test_the_blocking_stream_client_closes_within_its_grace_too():
    loop = asyncio.new_event_loop()
    server, servicer, target = loop.run_until_complete(_silent_server())
    serving = threading.Thread(target=loop.run_forever, daemon=True)
    serving.start()
    outcome: list[BaseException] = []
    try:
        with RiskClient(target) as client:
            stream = client.stream()

            def call() -> None:
                try:
                    stream.score(pb.ScoreRequest(request_id="r1"))
                except StreamClosed as exc:
                    outcome.append(exc)

            caller = threading.Thread(target=call)
            caller.start()
            wait_until(lambda: servicer.read == ["r1"])
            stream.close(grace_s=0.05)
            caller.join()
            try:  # and a request after the close is refused at once
                stream.score(pb.ScoreRequest(request_id="r2"))
            except StreamClosed as exc:
                outcome.append(exc)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        serving.join()
        loop.close()
    assert len(outcome) == 2


def test_a_stream_whose_client_closes_under_it_fails_what_it_holds_and_what_comes_after():
    """A stream from `client.stream()` still open when its client closes (the channel goes):
    the request it carries fails with StreamClosed, as does any sent on it after."""

    async def run() -> tuple[BaseException | None, BaseException | None]:
        server, servicer, target = await _silent_server()
        try:
            client = AsyncRiskClient(target)
            stream = client.stream()
            waiting = asyncio.ensure_future(stream.score(pb.ScoreRequest(request_id="r1")))
            await until(lambda: servicer.read == ["r1"])
            await client.close()
            await asyncio.wait({waiting}, timeout=30)
            try:
                await asyncio.wait_for(stream.score(pb.ScoreRequest(request_id="r2")), 30)
                after = None
            except (StreamClosed, TimeoutError) as exc:
                after = exc
            return waiting.exception() if waiting.done() else None, after
        finally:
            await server.stop(None)

    held, after = asyncio.run(run())
    assert isinstance(held, StreamClosed) and "channel was closed" in str(held), held
    assert isinstance(after, StreamClosed)


def test_a_blocking_stream_that_cannot_start_ends_its_loop_thread(tmp_path):
    """A start that fails (a TLS file that cannot be read) leaves no event-loop thread behind,
    one more with each attempt."""
    connection = Connection("127.0.0.1:1", tls_ca_file=tmp_path / "missing-ca.pem")
    for _ in range(3):
        with pytest.raises(OSError):
            ScoreStream(connection)
    assert [t.name for t in threading.enumerate() if t.name == "riskclient-stream"] == []
