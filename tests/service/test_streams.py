"""ScoreStream and ModelStreamInfer: answers by id on one open call, a status per message, the
per-message deadline and in-flight bound, driven by the project's client, tritonclient and raw
gRPC."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from fakes import fake_factory
from liveserver import LiveServer
from modelkit import write_sequence_model
from waiting import until

from demo.generator import generate, model_inputs
from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from riskclient import AsyncRiskClient, RiskClient, ScoringError
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

CODE = {c.value[0]: c for c in grpc.StatusCode}


def credit(i: int, **fields) -> pb.ScoreRequest:
    fields.setdefault("model", "credit-lite")
    return pb.ScoreRequest(
        request_id=f"c{i}", features={f"f{j}": 0.05 * ((i + j) % 11) for j in range(5)}, **fields
    )


def seq(i: int, **fields) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=f"s{i}",
        features={f"x{j}": 0.1 * j for j in range(4)},
        history=[pb.HistoryRow(values=[0.5, 1.0, -1.0])] * 2,
        **fields,
    )


async def raw_stream(target: str, messages: list) -> tuple[list[pb.ScoreResponse], grpc.StatusCode]:
    """Send `messages` (ScoreRequests, or bytes sent as they are) on one ScoreStream call."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.stream_stream(
            "/riskscoring.v1.RiskScoring/ScoreStream",
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=pb.ScoreResponse.FromString,
        )(iter(messages))
        replies = [reply async for reply in call]
        return replies, await call.code()


def test_stream_answers_many_concurrent_callers_by_id(live):
    requests = [credit(i) for i in range(64)]
    with live.channel() as channel:
        unary = {
            r.request_id: pb_grpc.RiskScoringStub(channel).Score(r, timeout=10) for r in requests
        }

    async def callers():
        async with AsyncRiskClient(live.target) as client, client.stream() as stream:
            return await asyncio.gather(*(stream.score(r) for r in requests))

    replies = asyncio.run(callers())
    assert [r.request_id for r in replies] == [r.request_id for r in requests]
    for reply in replies:
        expected = unary[reply.request_id]
        assert reply.score == expected.score
        assert reply.decision == expected.decision
        assert (reply.model, reply.model_version) == ("credit-lite", expected.model_version)
        assert reply.engine == expected.engine
        assert reply.status.code == 0


def test_sync_stream_is_shared_by_threads(live):
    results: dict[str, float] = {}

    def caller(stream, k: int) -> None:
        for i in range(k * 10, k * 10 + 10):
            results[f"c{i}"] = stream.score(credit(i), timeout_s=10).score

    with RiskClient(live.target) as client, client.stream() as stream:
        threads = [threading.Thread(target=caller, args=(stream, k)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        direct = client.score(credit(7), timeout_s=10)
        batch = client.score_batch([credit(1), credit(2)], model="credit-lite", timeout_s=10)
    assert len(results) == 80
    assert results["c7"] == direct.score
    assert [r.request_id for r in batch] == ["c1", "c2"]
    assert [r.score for r in batch] == [results["c1"], results["c2"]]


def test_a_failed_message_is_answered_and_the_stream_stays_open(live):
    unknown = credit(2)
    unknown.features["bogus"] = 1.0
    messages = [
        credit(1),
        unknown,
        credit(3, model="no-such-model"),
        b"\xff\xff\xff",  # not a ScoreRequest at all
        credit(4),
    ]
    replies, code = asyncio.run(raw_stream(live.target, messages))
    assert code == grpc.StatusCode.OK
    by_id = {r.request_id: r for r in replies}
    assert len(replies) == 5
    assert by_id["c1"].status.code == 0 and by_id["c4"].status.code == 0
    assert by_id["c4"].model == "credit-lite"
    assert CODE[by_id["c2"].status.code] == grpc.StatusCode.INVALID_ARGUMENT
    assert "bogus" in by_id["c2"].status.message
    assert CODE[by_id["c3"].status.code] == grpc.StatusCode.NOT_FOUND
    assert CODE[by_id[""].status.code] == grpc.StatusCode.INVALID_ARGUMENT
    assert "ScoreRequest" in by_id[""].status.message


def test_the_client_raises_a_failed_message_and_keeps_the_stream(live):
    async def run():
        async with AsyncRiskClient(live.target) as client, client.stream() as stream:
            bad = credit(1)
            bad.features["f0"] = float("nan")
            del bad.features["f4"]
            with pytest.raises(ScoringError) as err:
                await stream.score(bad)
            good = await stream.score(credit(2))
            return err.value, good, stream.reconnects

    error, good, reconnects = asyncio.run(run())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.request_id == "c1"
    assert "features" in error.message
    assert good.status.code == 0 and good.request_id == "c2"
    assert reconnects == 0


@pytest.fixture(scope="module")
def seq_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-models")
    write_sequence_model(root)
    return root


def test_a_message_deadline_is_its_own(seq_models):
    # Each batch takes 50 ms: a message allowing 5 ms is refused at once, one on the default
    # budget is scored, and the stream carries on.
    factory, _ = fake_factory(base_s=0.05)
    server = LiveServer(
        engine_factory=factory, models_dir=seq_models, default_model="seq-mini", budget_ms=5000
    )

    async def run(target):
        async with AsyncRiskClient(target) as client, client.stream() as stream:
            late = stream.score(seq(1, timeout_us=5000))
            on_budget = stream.score(seq(2))
            with_timeout = stream.score(seq(3), timeout_s=0.005)
            return await asyncio.gather(late, on_budget, with_timeout, return_exceptions=True)

    with server:
        late, on_budget, with_timeout = asyncio.run(run(server.target))
    assert isinstance(late, ScoringError) and late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert late.request_id == "s1"
    assert isinstance(on_budget, pb.ScoreResponse) and on_budget.engine == "fake"
    assert isinstance(with_timeout, ScoringError)
    assert with_timeout.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_messages_beyond_the_in_flight_bound_get_resource_exhausted(seq_models):
    hang = threading.Event()
    factory, made = fake_factory()
    server = LiveServer(
        engine_factory=factory,
        models_dir=seq_models,
        default_model="seq-mini",
        budget_ms=10000,
        max_stream_in_flight=4,
        warmup_iterations=0,
    )
    replies: list[pb.ScoreResponse] = []

    async def run(target):
        async with grpc.aio.insecure_channel(target) as channel:
            call = pb_grpc.RiskScoringStub(channel).ScoreStream()
            for i in range(10):
                await call.write(seq(i))
            reader = asyncio.ensure_future(_collect(call, replies))
            await until(lambda: len(replies) >= 6)
            refused = list(replies)
            hang.set()
            await until(lambda: len(replies) == 10)
            await call.done_writing()
            await reader
            return refused, await call.code()

    with server:
        made["seq-mini"].hang = hang  # from now on: the load's probe of the output layout ran
        try:
            refused, code = asyncio.run(run(server.target))
        finally:
            hang.set()
    assert code == grpc.StatusCode.OK
    assert [CODE[r.status.code] for r in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6
    assert "in flight" in refused[0].status.message
    scored = [r for r in replies if r.status.code == 0]
    assert sorted(r.request_id for r in scored) == ["s0", "s1", "s2", "s3"]
    assert sorted(r.request_id for r in replies) == sorted(f"s{i}" for i in range(10))


async def _collect(call, into: list) -> None:
    async for reply in call:
        into.append(reply)


def test_stream_messages_are_measured_like_unary_calls(seq_models):
    import re
    import urllib.request

    factory, _ = fake_factory()
    server = LiveServer(
        engine_factory=factory,
        models_dir=seq_models,
        default_model="seq-mini",
        budget_ms=5000,
        metrics_port=0,
    )
    bad = seq(9)
    bad.features["bogus"] = 1.0
    with server:
        replies, _ = asyncio.run(raw_stream(server.target, [seq(1), seq(2), bad]))
        assert len(replies) == 3
        port = server.server.telemetry.metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    def value(pattern: str) -> float:
        return sum(float(m) for m in re.findall(pattern + r" ([0-9.e+]+)", text))

    assert value(r'riskserve_requests_total\{[^}]*model="seq-mini"[^}]*status="OK"[^}]*\}') == 2
    assert value(r'riskserve_requests_total\{[^}]*status="INVALID_ARGUMENT"[^}]*\}') == 1


def test_model_stream_infer_with_tritonclient(live, models_root, tmp_path):
    data = generate(8, seed=77)
    arrays = model_inputs(data)
    npz = tmp_path / "inputs.npz"
    np.savez(npz, **arrays)
    client = Path(__file__).with_name("oip_stream_client.py")
    run = subprocess.run(
        [sys.executable, str(client), live.target, "fraud-demo", str(npz)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    got = out["got"]
    errors = got.pop("errors")
    assert sorted(got) == sorted(f"r{i}" for i in range(8))
    assert len(errors) == 2
    assert any("no-such-model" in e for e in errors)
    assert any("deadline" in e for e in errors)
    session = ort.InferenceSession(
        str(models_root / "fraud-demo" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    expected = session.run(["score"], arrays)[0].reshape(-1)
    np.testing.assert_allclose([got[f"r{i}"]["score"] for i in range(8)], expected, atol=1e-6)


def test_model_stream_infer_echoes_the_id_of_a_failed_request(live):
    def infer(request_id: str, model: str, n_features: int) -> oip.ModelInferRequest:
        tensor = oip.ModelInferRequest.InferInputTensor(
            name="x",
            datatype="FP32",
            shape=[1, n_features],
            contents=oip.InferTensorContents(fp32_contents=[0.1] * n_features),
        )
        return oip.ModelInferRequest(model_name=model, id=request_id, inputs=[tensor])

    async def run():
        async with grpc.aio.insecure_channel(live.target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            call = stub.ModelStreamInfer(
                iter(
                    [
                        infer("a", "credit-lite", 5),
                        infer("b", "credit-lite", 3),
                        infer("c", "credit-lite", 5),
                    ]
                )
            )
            return [r async for r in call], await call.code()

    replies, code = asyncio.run(run())
    assert code == grpc.StatusCode.OK
    by_id = {r.infer_response.id: r for r in replies}
    assert sorted(by_id) == ["a", "b", "c"]
    assert by_id["a"].error_message == "" and by_id["c"].error_message == ""
    assert by_id["a"].infer_response.outputs[0].name == "score"
    assert "x.shape" in by_id["b"].error_message
    assert by_id["b"].infer_response.model_name == "credit-lite"
