"""A request given up on a shared stream (timed out, cancelled) is still answered by the server
later; a request sent again under its id must get its own answer, never that late one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from liveserver import riskscoring_server
from waiting import until

from riskclient import AsyncRiskClient, AsyncScoreStream, ScoringError
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc


class _HoldsTheFirst(pb_grpc.RiskScoringServicer):
    """Answers each request with its feature `x` as the score: the first streamed request once
    `release` is set, every other at once; unary calls at once, noted in `unary`."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.unary: list[str] = []
        self._held = False

    async def ScoreStream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ScoreResponse]:
        answers: asyncio.Queue[pb.ScoreResponse | None] = asyncio.Queue()
        pending: set[asyncio.Task[None]] = set()

        async def answer(request: pb.ScoreRequest, hold: bool) -> None:
            if hold:
                await self.release.wait()
            await answers.put(_answer(request))

        async def read() -> None:
            async for request in request_iterator:
                hold, self._held = not self._held, True
                pending.add(asyncio.ensure_future(answer(request, hold)))
            await asyncio.gather(*pending)  # the caller half-closed: end once all answered
            await answers.put(None)

        reader = asyncio.ensure_future(read())
        await context.send_initial_metadata(())
        try:
            while (reply := await answers.get()) is not None:
                yield reply
        finally:
            reader.cancel()

    async def Score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse:
        self.unary.append(request.request_id)
        return _answer(request)


def _answer(request: pb.ScoreRequest) -> pb.ScoreResponse:
    return pb.ScoreResponse(request_id=request.request_id, score=request.features["x"])


def _order(x: float, request_id: str = "order-7") -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=request_id, features={"x": x})


async def _server() -> tuple[grpc.aio.Server, _HoldsTheFirst, str]:
    servicer = _HoldsTheFirst()
    server, target = await riskscoring_server(servicer)
    return server, servicer, target


def test_a_stream_takes_an_id_given_up_again_only_once_its_late_answer_came():
    async def run() -> float:
        server, servicer, target = await _server()
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                stream = AsyncScoreStream(channel)
                with pytest.raises(ScoringError) as timed_out:
                    await stream.score(_order(1.0), timeout_s=0.2)
                assert timed_out.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                assert stream.carries("order-7")
                with pytest.raises(ValueError, match="its answer is still due"):
                    await stream.score(_order(2.0), timeout_s=5)
                servicer.release.set()  # the late answer, for x = 1, comes and is dropped
                await until(lambda: stream.answered == 1)
                assert not stream.carries("order-7")
                reply = await stream.score(_order(2.0), timeout_s=5)
                await stream.close()
                return reply.score
        finally:
            await server.stop(None)

    assert asyncio.run(run()) == 2.0


def test_the_client_sends_an_id_given_up_on_its_stream_again_as_a_unary_call():
    async def run() -> tuple[float, list[str]]:
        server, servicer, target = await _server()
        try:
            async with AsyncRiskClient(target) as client:
                await client.score(_order(0.0, "warm-up"), timeout_s=5)  # a connection up
                # A call made while another is in flight takes the shared stream: order-7,
                # held there by the server until it times out.
                other, held = await asyncio.gather(
                    client.score(_order(3.0, "order-8"), timeout_s=5),
                    client.score(_order(1.0), timeout_s=0.2),
                    return_exceptions=True,
                )
                assert isinstance(other, pb.ScoreResponse) and other.score == 3.0
                assert isinstance(held, ScoringError), held
                reply = await client.score(_order(2.0), timeout_s=5)
                servicer.release.set()
                return reply.score, servicer.unary
        finally:
            await server.stop(None)

    score, unary = asyncio.run(run())
    assert score == 2.0 and unary == ["warm-up", "order-8", "order-7"]
