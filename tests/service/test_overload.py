"""Beyond capacity the server sheds load instead of letting every request get slow.

A 5 ms engine without batching serves about 200 requests a second; 16 clients calling back to
back would queue for about 80 ms each. With a 50 ms budget the batcher refuses what cannot make
it (DEADLINE_EXCEEDED, or RESOURCE_EXHAUSTED on a full queue) and scores what it admits. The
server runs in its own process, so the clients do not share its GIL. How the admitted requests'
latency compares with the budget is measured by bench/overload.py, not asserted here.
"""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from liveserver import REPO, server_process
from modelkit import write_sequence_model
from scrape import scraped_total
from waiting import wait_until

from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

BUDGET_MS = 50
ENGINE_S = 0.005
CLIENTS = 16
CALLS_PER_CLIENT = 40
SHED_CODES = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def seq_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("overload")
    write_sequence_model(root)
    return root


async def hammer(target: str) -> tuple[list[pb.ScoreResponse], list[grpc.StatusCode]]:
    request = pb.ScoreRequest(
        features={f"x{j}": 0.1 for j in range(4)}, history=[pb.HistoryRow(values=[1, 2, 3])]
    )
    admitted: list[pb.ScoreResponse] = []
    shed: list[grpc.StatusCode] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        await stub.Score(request, timeout=5)  # connected and warm

        async def client() -> None:
            for _ in range(CALLS_PER_CLIENT):
                try:
                    admitted.append(await stub.Score(request))  # no gRPC deadline: the budget
                except grpc.aio.AioRpcError as exc:
                    shed.append(exc.code())
                    await asyncio.sleep(0.02)  # a shed client backs off, as real ones do

        await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return admitted, shed


def test_overload_sheds_what_cannot_make_the_budget_and_scores_the_rest(seq_models):
    env = {
        "RISKSERVE_BUDGET_MS": str(BUDGET_MS),
        "RISKSERVE_DEFAULT_MODEL": "seq-mini",
        "RISKSERVE_MAX_BATCH_SIZE": "1",
        "RISKSERVE_MAX_QUEUE_ROWS": "64",
        "RISKSERVE_WARMUP_ITERATIONS": "3",
        "RISKSERVE_METRICS_PORT": "0",
    }
    argv = (str(REPO / "tests" / "support" / "fake_server.py"), str(seq_models), str(ENGINE_S))
    output: list[str] = []
    with server_process(seq_models, argv=argv, output=output, **env) as (_, target):
        admitted, shed = asyncio.run(hammer(target))
        (url,) = {m[1] for line in output if (m := re.search(r"metrics on (\S+)", line))}
        # Each call is counted just after its status is sent: the last ones come a bit later.
        wait_until(
            lambda: scraped_total(url, "riskserve_requests_total") == 1 + len(shed) + len(admitted)
        )
        ok = scraped_total(url, "riskserve_requests_total", status="OK")
        shed_counted = {
            reason: scraped_total(url, "riskserve_shed_total", reason=reason)
            for reason in ("deadline", "queue_full", "concurrency")
        }
        total_shed = scraped_total(url, "riskserve_shed_total")
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )

    print(f"overload: {len(admitted)} admitted, {len(shed)} shed {shed_counted}")
    assert len(admitted) + len(shed) == CLIENTS * CALLS_PER_CLIENT  # every call answered
    assert shed, "the load never went beyond capacity"
    assert set(shed) <= SHED_CODES
    # What was admitted was scored, by the engine, never answered degraded.
    assert admitted
    assert all(r.engine == "fake" and not r.degraded and 0 <= r.score <= 1 for r in admitted)
    # The server counts each refusal once, under its reason, and each scored call as OK.
    assert total_shed == sum(shed_counted.values()) == len(shed)
    assert shed_counted["deadline"] == shed.count(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert ok == 1 + len(admitted)
    # Shedding is how it stays healthy: it still serves.
    assert health.status == health_pb2.HealthCheckResponse.SERVING
