"""Calls and stream messages refused before any scoring are requests all the same: each is in
riskserve_requests_total with its status, and its error trace is kept, as for any failed call
(docs/telemetry.md). Two such refusals were only in the shed count, or in nothing."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
from fakes import fake_factory
from liveserver import LiveServer
from modelkit import sequence_request, write_sequence_model
from scrape import scraped_total
from waiting import wait_until

from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc


def _serve(tmp_path: Path, **settings: object) -> LiveServer:
    write_sequence_model(tmp_path / "models")
    factory, _ = fake_factory(base_s=0.3)  # each call held long enough for the next to come
    return LiveServer(
        factory,
        models_dir=tmp_path / "models",
        default_model="seq-mini",
        budget_ms=5000,
        metrics_port=0,
        trace_file=tmp_path / "traces.jsonl",
        **settings,
    )


def _metrics(live: LiveServer) -> str:
    assert live.server is not None and live.server.telemetry.metrics_url is not None
    return live.server.telemetry.metrics_url


def test_a_call_refused_at_the_concurrency_limit_is_counted_and_traced(tmp_path: Path):
    with _serve(tmp_path, max_requests_in_progress=1) as live, live.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        codes: list[grpc.StatusCode] = []

        def call(i: int) -> None:
            try:
                stub.Score(sequence_request(i, 3), timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())

        callers = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
        refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert refused and grpc.StatusCode.OK in codes
        url = _metrics(live)
        wait_until(
            lambda: (
                scraped_total(
                    url, "riskserve_requests_total", method="Score", status="RESOURCE_EXHAUSTED"
                )
                == refused
            )
        )
        assert scraped_total(url, "riskserve_traces_total", decision="error") >= refused


def test_stream_messages_beyond_the_streams_limit_are_counted_and_traced(tmp_path: Path):
    with _serve(tmp_path, max_stream_in_flight=1) as live, live.channel() as channel:
        replies = list(
            pb_grpc.RiskScoringStub(channel).ScoreStream(
                iter([sequence_request(i, 3) for i in range(5)]), timeout=30
            )
        )
        refused = sum(
            1 for r in replies if r.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        )
        assert refused, replies
        url = _metrics(live)
        wait_until(
            lambda: (
                scraped_total(
                    url,
                    "riskserve_requests_total",
                    method="ScoreStream",
                    status="RESOURCE_EXHAUSTED",
                )
                == refused
            )
        )
        assert scraped_total(url, "riskserve_traces_total", decision="error") >= refused
