"""Open-loop Score load on the domain API: the demo's requests at Poisson send times.

The requests are rows of the demo generator (a seed training never uses), serialized once. Each
stream of requests has its send times drawn up front; every request is sent at its time
whatever the others are doing, and its latency runs from that scheduled time, so a client or
server that falls behind shows as latency. Each call has a gRPC deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from bench.loadgen import poisson_offsets
from demo.generator import FEATURE_NAMES, generate
from riskscoring.v1 import risk_scoring_pb2 as pb

SCORE_METHOD = "/riskscoring.v1.RiskScoring/Score"
HELD_OUT_SEED = 5_000_011


def score_requests(
    n: int, max_history: int, prefix: str = "r", explain: tuple[int, int] | None = None
) -> list[bytes]:
    """`n` serialized ScoreRequests of the demo's rows, histories cut to `max_history` rows;
    `explain` is (explain_top_k, explain_when) for explained requests."""
    data = generate(n, seed=HELD_OUT_SEED)
    out = []
    for i in range(n):
        request = pb.ScoreRequest(
            request_id=f"{prefix}{i}",
            entity_id=data.entity_ids[i],
            features={k: float(v) for k, v in zip(FEATURE_NAMES, data.features[i], strict=True)},
            history=[pb.HistoryRow(values=r.tolist()) for r in data.histories[i][:max_history]],
        )
        if explain:
            request.explain_top_k, request.explain_when = explain
        out.append(request.SerializeToString())
    return out


@dataclass
class ScoreStream:
    """One kind of request in a run: what is sent, when, and how each answer went."""

    payloads: list[bytes]
    offsets: np.ndarray  # send times, s from the start
    latencies_s: list[float] = field(default_factory=list)
    server_us: list[int] = field(default_factory=list)  # the answer's timings.total_us
    batch_rows: list[int] = field(default_factory=list)
    reasons: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    @classmethod
    def poisson(
        cls, payloads: list[bytes], rate_rps: float, duration_s: float, seed: int
    ) -> ScoreStream:
        return cls(payloads, poisson_offsets(rate_rps, duration_s, 1 << 30, seed))

    def latencies_ms(self) -> np.ndarray:
        return np.array(self.latencies_s) * 1e3


async def open_loop(
    target: str,
    streams: Sequence[ScoreStream],
    on_start: Callable[[], None],
    *,
    warmup: int,
    settle_s: float,
    timeout_s: float,
) -> None:
    """Warms the server with each stream's first `warmup` requests, waits `settle_s`, calls
    `on_start` and then sends every stream's requests at their times."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(SCORE_METHOD, response_deserializer=pb.ScoreResponse.FromString)
        for stream in streams:
            for payload in stream.payloads[:warmup]:
                await call(payload, timeout=5)
        await asyncio.sleep(settle_s)
        on_start()
        start = time.perf_counter() + 0.1

        async def one(stream: ScoreStream, i: int, at: float) -> None:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                reply = await call(stream.payloads[i % len(stream.payloads)], timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                stream.errors[exc.code().name] = stream.errors.get(exc.code().name, 0) + 1
                return
            stream.latencies_s.append(time.perf_counter() - (start + at))
            stream.server_us.append(reply.timings.total_us)
            stream.batch_rows.append(reply.timings.batch_size)
            stream.reasons.append(len(reply.reasons))

        await asyncio.gather(
            *(one(s, i, float(at)) for s in streams for i, at in enumerate(s.offsets))
        )
