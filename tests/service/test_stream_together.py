"""ModelStreamInfer messages read in one turn of the event loop are decoded and queued together,
and each is still answered, checked and counted as its own."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from liveserver import LiveServer
from waiting import wait_until

from demo.generator import generate, model_inputs
from engines.manifest import load_manifest
from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from service.api.codec import decode_infer_request, decode_infer_together
from service.batching.batcher import MicroBatcher
from service.batching.budget import MARGIN
from service.errors import InvalidRequest

ROWS = 16


@pytest.fixture(scope="module")
def arrays() -> dict[str, np.ndarray]:
    return model_inputs(generate(ROWS, seed=11))


def infer(arrays: dict[str, np.ndarray], row: int, request_id: str = "") -> oip.ModelInferRequest:
    """Row `row` of the demo model's inputs as one raw-content ModelInferRequest."""
    request = oip.ModelInferRequest(model_name="fraud-demo", id=request_id or f"r{row}")
    for name, array in arrays.items():
        part = np.ascontiguousarray(array[row : row + 1], dtype="<f4")
        request.inputs.add(name=name, datatype="FP32", shape=list(part.shape))
        request.raw_input_contents.append(part.tobytes())
    return request


def test_alike_requests_decode_as_one_batch_equal_to_each_alone(models_root, arrays):
    manifest = load_manifest(models_root / "fraud-demo" / "1")
    requests = [infer(arrays, row) for row in range(ROWS)]
    together = decode_infer_together(requests, manifest, "score")
    assert together is not None and together.rows == ROWS
    alone = [decode_infer_request(r, manifest, "score") for r in requests]
    np.testing.assert_array_equal(together.features, np.concatenate([a.features for a in alone]))
    np.testing.assert_array_equal(together.history, np.concatenate([a.history for a in alone]))
    np.testing.assert_array_equal(together.mask, np.concatenate([a.mask for a in alone]))


def test_requests_that_differ_or_fail_a_check_are_left_to_decode_alone(models_root, arrays):
    manifest = load_manifest(models_root / "fraud-demo" / "1")
    shorter = {k: (v[:, :8] if v.ndim > 1 and k != "features" else v) for k, v in arrays.items()}
    assert decode_infer_together([infer(arrays, 0), infer(shorter, 1)], manifest, "score") is None
    poisoned = {k: v.copy() for k, v in arrays.items()}
    poisoned["features"][2, 0] = np.nan
    requests = [infer(poisoned, row) for row in range(4)]
    assert decode_infer_together(requests, manifest, "score") is None
    # Alone, the failing request names its own field; the others decode.
    with pytest.raises(InvalidRequest, match="features"):
        decode_infer_request(requests[2], manifest, "score")
    decode_infer_request(requests[3], manifest, "score")


def test_concurrent_streams_get_each_message_answered_and_counted(models_root, arrays):
    streams, bad = 4, {("s1", 5), ("s3", 9)}

    def message(stream: str, row: int) -> oip.ModelInferRequest:
        request = infer(arrays, row, f"{stream}-{row}")
        if (stream, row) in bad:  # NaN features: this model rejects them
            values = np.frombuffer(request.raw_input_contents[0], dtype="<f4").copy()
            values[0] = np.nan
            request.raw_input_contents[0] = values.tobytes()
        return request

    async def run(target: str) -> dict[str, oip.ModelStreamInferResponse]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)

            async def one(stream: str) -> list[oip.ModelStreamInferResponse]:
                call = stub.ModelStreamInfer(iter([message(stream, r) for r in range(ROWS)]))
                replies = [reply async for reply in call]
                assert await call.code() == grpc.StatusCode.OK
                return replies

            answered = await asyncio.gather(*(one(f"s{i}") for i in range(streams)))
        by_id = {reply.infer_response.id: reply for replies in answered for reply in replies}
        assert sum(len(replies) for replies in answered) == len(by_id)  # each answered once
        return by_id

    server = LiveServer(
        models_dir=models_root,
        budget_ms=5000,
        onnx_variants=False,
        metrics_port=0,
        max_batch_size=32,
    )
    with server:
        by_id = asyncio.run(run(server.target))
        port = server.server.telemetry.metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    assert sorted(by_id) == sorted(f"s{s}-{r}" for s in range(streams) for r in range(ROWS))
    session = ort.InferenceSession(
        str(models_root / "fraud-demo" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    expected = session.run(["score"], arrays)[0].reshape(-1)
    for request_id, reply in by_id.items():
        stream, row = request_id.split("-")
        if (stream, int(row)) in bad:
            assert "NaN" in reply.error_message and "features" in reply.error_message
            continue
        assert reply.error_message == ""
        score = np.frombuffer(reply.infer_response.raw_output_contents[0], dtype="<f4")
        np.testing.assert_allclose(score, expected[int(row)], atol=1e-6)

    def counted(status: str) -> float:
        labels = rf'[^}}]*method="ModelStreamInfer"[^}}]*status="{status}"[^}}]*'
        pattern = rf"riskserve_requests_total\{{{labels}\}} ([0-9.e+]+)"
        return sum(float(m) for m in re.findall(pattern, text))

    assert counted("OK") == streams * ROWS - len(bad)
    assert counted("INVALID_ARGUMENT") == len(bad)


def _named_twice(arrays: dict[str, np.ndarray], row: int, request_id: str) -> oip.ModelInferRequest:
    """Row `row` with its features given a second time, as two rows."""
    request = infer(arrays, row, request_id)
    twice = np.ascontiguousarray(arrays["features"][row : row + 2], dtype="<f4")
    request.inputs.add(name="features", datatype="FP32", shape=list(twice.shape))
    request.raw_input_contents.append(twice.tobytes())
    return request


def _no_values(request_id: str) -> oip.ModelInferRequest:
    """Features of no values in a shape numpy cannot hold."""
    request = oip.ModelInferRequest(model_name="fraud-demo", id=request_id)
    request.inputs.add(name="features", datatype="FP32", shape=[0, 2**62])
    request.raw_input_contents.append(b"")
    return request


def test_a_callers_bad_or_hasty_messages_cost_no_other_callers_answer(models_root, arrays):
    """Messages of one turn are decoded and queued together, but each caller's are answered as
    their own: inputs named twice and shapes numpy cannot hold are refused (as by ModelInfer),
    a message whose own `timeout` cannot be met is shed alone, and the well-formed messages
    read beside them get their own scores."""
    good_streams = 4
    kinds = {
        "twice": lambda i: _named_twice(arrays, i % (ROWS - 1), f"twice-{i}"),
        "novalues": lambda i: _no_values(f"novalues-{i}"),
        "hasty": lambda i: _timed(infer(arrays, i % ROWS, f"hasty-{i}"), timeout_us=1),
    }

    async def run(target: str) -> tuple[dict[str, oip.ModelStreamInferResponse], dict[str, str]]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)

            async def one(messages: list[oip.ModelInferRequest]) -> list:
                call = stub.ModelStreamInfer(iter(messages))
                replies = [reply async for reply in call]
                assert await call.code() == grpc.StatusCode.OK
                return replies

            good = [
                [infer(arrays, r, f"s{s}-{r}") for r in range(ROWS) for _ in range(4)]
                for s in range(good_streams)
            ]
            bad = [[make(i) for i in range(4 * ROWS)] for make in kinds.values()]
            answered = await asyncio.gather(*(one(m) for m in good + bad))
            unary = {}
            for name in ("twice", "novalues"):
                make = kinds[name]
                try:
                    await stub.ModelInfer(make(0))
                except grpc.aio.AioRpcError as exc:
                    unary[name] = f"{exc.code().name}: {exc.details()}"
        by_id = {reply.infer_response.id: reply for replies in answered for reply in replies}
        return by_id, unary

    server = LiveServer(
        models_dir=models_root, budget_ms=5000, onnx_variants=False, max_batch_size=32
    )
    with server:
        by_id, unary = asyncio.run(run(server.target))

    session = ort.InferenceSession(
        str(models_root / "fraud-demo" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    expected = session.run(["score"], arrays)[0].reshape(-1)
    good = [(i, reply) for i, reply in by_id.items() if i.startswith("s")]
    assert len(good) == good_streams * ROWS  # ids repeat four times a stream: one reply each
    for request_id, reply in good:
        assert reply.error_message == ""
        score = np.frombuffer(reply.infer_response.raw_output_contents[0], dtype="<f4")
        np.testing.assert_allclose(score, expected[int(request_id.split("-")[1])], atol=1e-6)
    refusals = {
        "twice": "inputs[3].name: 'features' is given twice",
        "novalues": (
            "inputs[0].shape: [0, 4611686018427387904] has dimensions too large or too many"
        ),
    }
    for name, details in refusals.items():
        replies = [reply for i, reply in by_id.items() if i.startswith(name)]
        assert len(replies) == 4 * ROWS
        assert {reply.error_message for reply in replies} == {details}
        assert unary[name] == f"INVALID_ARGUMENT: {details}"
    hasty = [reply for i, reply in by_id.items() if i.startswith("hasty")]
    assert len(hasty) == 4 * ROWS and all("deadline" in r.error_message for r in hasty)


def _timed(request: oip.ModelInferRequest, timeout_us: int) -> oip.ModelInferRequest:
    """`request` with Triton's per-request `timeout` parameter (microseconds)."""
    request.parameters["timeout"].int64_param = timeout_us
    return request


def test_messages_scored_together_get_the_deadline_every_path_gets(
    models_root, arrays, monkeypatch
):
    """The batcher plans a message scored with others by the same deadline as one scored on
    its own (`Budget.deadline`, the margin kept back), with and without its own `timeout`."""
    planned: list[tuple[int, float]] = []
    submit = MicroBatcher.submit

    async def spy(self, batch, deadline, requests=1):
        planned.append((requests, deadline - time.monotonic()))
        return await submit(self, batch, deadline, requests)

    monkeypatch.setattr(MicroBatcher, "submit", spy)

    async def run(target: str) -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            for timeout_us in (0, 2_000_000):
                for alone in (False, True):
                    request = _timed(infer(arrays, 0), timeout_us)
                    if alone:  # an entity names a route: the message goes the per-message path
                        request.parameters["entity_id"].string_param = "e1"
                    call = stub.ModelStreamInfer(iter([request]))
                    assert [r.error_message async for r in call] == [""]

    with LiveServer(models_dir=models_root, budget_ms=5000, onnx_variants=False) as server:
        asyncio.run(run(server.target))
    assert [requests for requests, _ in planned] == [1, 1, 1, 1]
    usable = (1 - MARGIN) * np.array([5.0, 5.0, 2.0, 2.0])
    np.testing.assert_allclose([left for _, left in planned], usable, atol=0.05)


def test_a_message_refused_before_scoring_keeps_its_error_trace(models_root, arrays, tmp_path):
    """A streamed message for a model not loaded is traced as its unary call would be: the
    error keeps its trace."""
    trace_file = tmp_path / "traces.jsonl"
    server = LiveServer(
        models_dir=models_root,
        onnx_variants=False,
        trace_file=trace_file,
        trace_sample_ratio=0.0,
    )
    elsewhere = infer(arrays, 0, "elsewhere")
    elsewhere.model_name = "not-loaded"
    with server, server.channel() as channel:
        stream = oip_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([elsewhere, infer(arrays, 1, "here")]), timeout=10
        )
        answers = [reply.error_message for reply in stream]
        assert "not loaded" in answers[0] or "not loaded" in answers[1]

        def error_spans() -> list[dict]:
            if not trace_file.exists():
                return []
            spans = [json.loads(line) for line in trace_file.read_text().splitlines()]
            return [s for s in spans if s["name"].endswith("/ModelStreamInfer")]

        wait_until(lambda: len(error_spans()) == 1)
    (span,) = error_spans()
    assert span["attributes"]["riskserve.sampled_reason"] == "error"
