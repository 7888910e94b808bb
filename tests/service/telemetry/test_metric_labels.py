"""Metric labels come only from what is loaded: callers naming anything cannot add series."""

from __future__ import annotations

import asyncio
import random
import string
import urllib.request

import grpc
import pytest
from fakes import fake_factory
from liveserver import LiveServer
from modelkit import write_sequence_model
from prometheus_client.parser import text_string_to_metric_families
from scrape import scraped_total
from waiting import until

from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc


def _series(url: str) -> list[tuple[str, dict[str, str]]]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return [
        (sample.name, dict(sample.labels))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("riskserve_")
    ]


def _requests_counted(url: str) -> float:
    return scraped_total(url, "riskserve_requests_total")


def _name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits + "-_.", k=rng.randint(1, 24)))


@pytest.fixture()
def server(tmp_path):
    write_sequence_model(tmp_path)
    factory, _ = fake_factory()
    with LiveServer(
        engine_factory=factory,
        models_dir=tmp_path,
        default_model="seq-mini",
        budget_ms=2000,
        warmup_iterations=0,
        metrics_port=0,
    ) as live:
        yield live


def test_a_thousand_unknown_models_and_versions_add_no_series(server):
    url = server.server.telemetry.metrics_url
    rng = random.Random(30)
    names = [_name(rng) for _ in range(1000)]
    with server.channel() as channel:
        score = pb_grpc.RiskScoringStub(channel)
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        # One failure of each kind first, so every series the flood could touch exists.
        for stub_call in (
            lambda: score.Score(pb.ScoreRequest(model="first"), timeout=5),
            lambda: score.Score(pb.ScoreRequest(model="first", model_version="1"), timeout=5),
            lambda: score.Score(pb.ScoreRequest(model="seq-mini", model_version="9"), timeout=5),
            lambda: infer.ModelInfer(oip.ModelInferRequest(model_name="first"), timeout=5),
            lambda: infer.ModelInfer(
                oip.ModelInferRequest(model_name="first", model_version="1"), timeout=5
            ),
        ):
            with pytest.raises(grpc.RpcError):
                stub_call()
        asyncio.run(until(lambda: _requests_counted(url) >= 5, timeout_s=10))
        before = _series(url)
        for i, name in enumerate(names):
            version = _name(rng) if i % 2 else ""
            try:
                if i % 3 == 0:
                    infer.ModelInfer(
                        oip.ModelInferRequest(model_name=name, model_version=version), timeout=5
                    )
                elif i % 3 == 1:
                    score.Score(pb.ScoreRequest(model=name, model_version=version), timeout=5)
                else:  # a loaded model, a version that is not
                    score.Score(pb.ScoreRequest(model="seq-mini", model_version=name), timeout=5)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND
            else:
                raise AssertionError(f"{name!r} {version!r} was answered")
        asyncio.run(until(lambda: _requests_counted(url) >= 1005, timeout_s=10))
        after = _series(url)

    assert len(after) == len(before)
    labels = {value for _, sample_labels in after for value in sample_labels.values()}
    assert "unknown" in labels
    assert not labels & set(names)
    models = {lbl["model"] for name, lbl in after if name == "riskserve_requests_total"}
    assert models == {"seq-mini", "unknown"}


def test_scoring_calls_refused_before_their_model_is_read_are_counted_as_unknown(server):
    """Malformed bytes, and OIP's empty model name, fail before any model is named: each is
    still a scoring request of the error rate, under model `unknown`."""
    url = server.server.telemetry.metrics_url
    with server.channel() as channel:
        raw_score = channel.unary_unary("/riskscoring.v1.RiskScoring/Score")
        raw_infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        infer = oip_grpc.GRPCInferenceServiceStub(channel)
        for refused in (
            lambda: raw_score(b"\xff\xff\xff", timeout=5),
            lambda: raw_infer(b"\xff\xff\xff", timeout=5),
            lambda: infer.ModelInfer(oip.ModelInferRequest(), timeout=5),
        ):
            with pytest.raises(grpc.RpcError) as failed:
                refused()
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def counted(method: str) -> float:
        return scraped_total(
            url,
            "riskserve_requests_total",
            method=method,
            model="unknown",
            status="INVALID_ARGUMENT",
        )

    asyncio.run(until(lambda: counted("Score") == 1 and counted("ModelInfer") == 2, timeout_s=10))
