"""A shared stream that breaks leaves nothing of itself waiting: the next stream alone sends.

gRPC does not stop the request generator of a call that failed: left waiting, the broken
stream's generator took the next stream's wake-up when it was woken, and requests then waited
in the client for good, unsent (test_stream_lifecycle.py's reconnect test hung that way).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc
from waiting import until

from riskclient import AsyncScoreStream
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc


class _BreaksFirstStream(pb_grpc.RiskScoringServicer):
    """Each stream sends its headers at once. The first reads one request and ends with
    UNAVAILABLE, unanswered; every later stream answers each request it reads."""

    def __init__(self) -> None:
        self.streams = itertools.count()

    async def ScoreStream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ScoreResponse]:
        await context.send_initial_metadata(())  # as riskserve does as a stream opens
        if next(self.streams) == 0:
            await anext(aiter(request_iterator))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
        async for request in request_iterator:
            yield pb.ScoreResponse(request_id=request.request_id, score=0.5)


def test_a_broken_streams_generator_ends_and_the_next_stream_sends_every_request(monkeypatch):
    made: list[AsyncIterator[pb.ScoreRequest]] = []
    requests = AsyncScoreStream._requests

    def recorded(self: AsyncScoreStream, generation: int) -> AsyncIterator[pb.ScoreRequest]:
        generator = requests(self, generation)
        made.append(generator)
        return generator

    monkeypatch.setattr(AsyncScoreStream, "_requests", recorded)

    async def run() -> tuple[list[str], int]:
        server = grpc.aio.server()
        pb_grpc.add_RiskScoringServicer_to_server(_BreaksFirstStream(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = AsyncScoreStream(channel, resend_unanswered=True, timeout_s=30)
                async with stream:
                    first = await stream.score(pb.ScoreRequest(request_id="r0"))
                    # The broken stream's generator has ended, not waiting to be woken.
                    await until(lambda: made[0].ag_frame is None)  # type: ignore[attr-defined]
                    # Wake-ups that come while the next stream sends reach its generator.
                    later = await asyncio.gather(
                        *(stream.score(pb.ScoreRequest(request_id=f"r{i}")) for i in range(1, 9))
                    )
                return [first.request_id, *(r.request_id for r in later)], stream.reconnects
        finally:
            await server.stop(None)

    ids, reconnects = asyncio.run(run())
    assert ids == [f"r{i}" for i in range(9)]
    assert reconnects == 1
    assert len(made) == 2
