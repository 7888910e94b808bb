"""The micro-batcher through a live server, with an engine of known latency."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import grpc
import numpy as np
import pytest
from fakes import expected_score, fake_factory
from liveserver import LiveServer
from modelkit import write_sequence_model
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from waiting import until

from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.batching.batcher import MicroBatcher, Scored
from service.batching.rows import RowBatch
from service.config import Settings
from service.errors import DeadlineMissed, Unavailable
from service.telemetry import setup_telemetry


@pytest.fixture(scope="module")
def seq_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("seq")
    write_sequence_model(root)
    return root


def request(i: int, rows: int = 2) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=str(i),
        features={f"x{j}": float((i * 7 + j) % 13) - 6.0 for j in range(4)},
        history=[pb.HistoryRow(values=[0.1 * i, 1.0, -1.0])] * rows,
    )


def want(i: int) -> float:
    r = request(i)
    return float(expected_score(np.array([[r.features[f"x{j}"] for j in range(4)]]))[0])


def serve(seq_models, **options):
    engine_options = {
        k: options.pop(k)
        for k in list(options)
        if k in ("base_s", "per_row_s", "fail", "concurrency")
    }
    factory, made = fake_factory(**engine_options)
    options.setdefault("default_model", "seq-mini")
    return LiveServer(engine_factory=factory, models_dir=seq_models, **options), made


def test_concurrent_clients_each_get_their_own_rows(seq_models):
    """Many clients at once: batches form, every reply carries its own request's score."""
    server, made = serve(
        seq_models,
        base_s=0.004,
        per_row_s=0.0001,
        budget_ms=2000,
        max_batch_size=16,
        warmup_iterations=0,
    )
    with server, server.channel() as channel:
        made["seq-mini"].batches.clear()  # the load's probe of the output layout
        stub = pb_grpc.RiskScoringStub(channel)
        ids = list(range(400))
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            replies = list(
                pool.map(lambda i: stub.Score(request(i, rows=1 + i % 9), timeout=10), ids)
            )
        assert sorted(int(r.request_id) for r in replies) == ids  # none lost, none twice
        for r in replies:
            assert r.score == pytest.approx(want(int(r.request_id)), abs=1e-6)
        engine = made["seq-mini"]
        assert max(engine.batches) > 1, "concurrent load formed no batch"
        assert max(engine.batches) <= 16
        assert sum(engine.batches) == len(ids)  # each row ran exactly once


def test_light_load_runs_each_request_in_a_batch_of_its_own(seq_models):
    server, made = serve(seq_models, base_s=0.001, warmup_iterations=0)
    with server, server.channel() as channel:
        made["seq-mini"].batches.clear()  # the load's probe of the output layout
        stub = pb_grpc.RiskScoringStub(channel)
        replies = [stub.Score(request(i), timeout=5) for i in range(20)]
    assert all(r.timings.batch_size == 1 for r in replies)
    assert made["seq-mini"].batches == [1] * 20


def test_idle_engine_adds_no_wait():
    """A lone request on an idle engine is scored within a few turns of the event loop, no
    timer between; a configured extra wait for company (max_queue_delay) would hold it."""

    def run(rows: RowBatch) -> Scored:
        return Scored(np.zeros(rows.rows, np.float32), "fake", "", 0.0001)

    async def scored_at_once(extra_wait_s: float) -> bool:
        batcher = MicroBatcher(
            run, max_batch_rows=16, max_queue_rows=64, workers=1, max_queue_delay_s=extra_wait_s
        )
        batcher.start()
        rows = RowBatch(np.zeros((1, 4), np.float32), None, None)
        # A deadline with room for the longest wait below, so that the wait is taken.
        scored = asyncio.create_task(batcher.submit(rows, time.monotonic() + 7200))
        for _ in range(10):
            await asyncio.sleep(0)  # one turn of the loop: no time passes for a timer
        at_once = scored.done()
        await batcher.close(1.0)  # closing dispatches what waits for company
        assert (await scored).engine == "fake"
        return at_once

    assert asyncio.run(scored_at_once(0.0))
    assert not asyncio.run(scored_at_once(3600.0))


def test_an_extra_wait_for_company_never_holds_a_request_past_its_room():
    """The configured extra wait (max_queue_delay) holds no request whose deadline has no room
    for it: one that comes so is scored at once, and one that comes during a wait ends it."""

    def run(rows: RowBatch) -> Scored:
        return Scored(np.zeros(rows.rows, np.float32), "fake", "", 0.0001)

    async def scenario() -> tuple[bool, bool, bool]:
        batcher = MicroBatcher(
            run, max_batch_rows=16, max_queue_rows=64, workers=1, max_queue_delay_s=3600.0
        )
        batcher.start()
        rows = RowBatch(np.zeros((1, 4), np.float32), None, None)

        async def within_turns(task: asyncio.Task[Scored]) -> bool:
            for _ in range(10):
                await asyncio.sleep(0)  # one turn of the loop: no time passes for a timer
            return task.done()

        hasty = asyncio.create_task(batcher.submit(rows, time.monotonic() + 60))
        hasty_at_once = await within_turns(hasty)
        patient = asyncio.create_task(batcher.submit(rows, time.monotonic() + 7200))
        patient_waits = not await within_turns(patient)
        joining = asyncio.create_task(batcher.submit(rows, time.monotonic() + 60))
        wait_ended = await within_turns(patient) and joining.done()
        await batcher.close(1.0)
        return hasty_at_once, patient_waits, wait_ended

    assert asyncio.run(scenario()) == (True, True, True)


def test_batching_off_with_max_batch_size_one(seq_models):
    server, made = serve(
        seq_models, base_s=0.002, max_batch_size=1, budget_ms=5000, warmup_iterations=0
    )
    with server, server.channel() as channel:
        made["seq-mini"].batches.clear()  # the load's probe of the output layout
        stub = pb_grpc.RiskScoringStub(channel)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda i: stub.Score(request(i), timeout=10), range(40)))
    assert {r.timings.batch_size for r in replies} == {1}
    assert set(made["seq-mini"].batches) == {1}


def test_request_that_cannot_make_its_deadline_fails_fast(seq_models):
    """Engine time 60 ms, deadline 20 ms: refused at once with DEADLINE_EXCEEDED, never run."""
    server, made = serve(seq_models, base_s=0.06, warmup_iterations=2)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        runs_before = len(made["seq-mini"].batches)
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(request(1), timeout=0.02)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # With the configured budget (10 ms) and no gRPC deadline, the same.
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(request(2))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "deadline" in err.value.details()
        assert len(made["seq-mini"].batches) == runs_before
        # A caller that allows more time is served.
        assert stub.Score(request(3), timeout=2).score == pytest.approx(want(3), abs=1e-6)


def test_deadline_degrades_to_fallback_decision_when_configured(seq_models):
    server, _ = serve(seq_models, base_s=0.06, warmup_iterations=2, degrade_on_deadline=True)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        late = stub.Score(request(1))  # the 10 ms budget cannot cover a 60 ms engine
        served = stub.Score(request(2), timeout=2)
    assert late.degraded and late.decision == pb.REVIEW and late.fallback_reason == "deadline"
    assert not served.degraded and served.score == pytest.approx(want(2), abs=1e-6)


def _seq_infer(i: int) -> oip.ModelInferRequest:
    """One seq-mini row as an OIP request (4 features, 4 history rows of 3 fields)."""
    request = oip.ModelInferRequest(model_name="seq-mini", id=f"r{i}")
    arrays = {
        "features": np.full((1, 4), 0.1 * i, np.float32),
        "history": np.full((1, 4, 3), 0.5, np.float32),
        "history_mask": np.ones((1, 4), np.float32),
    }
    for name, array in arrays.items():
        request.inputs.add(name=name, datatype="FP32", shape=list(array.shape))
        request.raw_input_contents.append(array.tobytes())
    return request


def test_a_degraded_request_on_the_inference_protocol_misses_its_deadline(seq_models):
    """The inference protocol has no fallback decision and no `degraded` flag: a request the
    batcher degrades is DEADLINE_EXCEEDED there, unary or streamed, never an OK of NaN."""
    server, _ = serve(seq_models, base_s=0.06, warmup_iterations=2, degrade_on_deadline=True)
    with server, server.channel() as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as late:
            stub.ModelInfer(_seq_infer(1))  # the 10 ms budget cannot cover a 60 ms engine
        (streamed,) = list(stub.ModelStreamInfer(iter([_seq_infer(2)]), timeout=10))
        served = stub.ModelInfer(_seq_infer(3), timeout=2)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline" in late.value.details()
    assert "deadline" in streamed.error_message and not streamed.infer_response.outputs
    assert np.isfinite(np.frombuffer(served.raw_output_contents[0], "<f4")).all()


def test_a_unary_inference_request_takes_its_own_timeout_as_a_streamed_one_does(seq_models):
    """Triton's `timeout` parameter (µs) sets a request's time within the call's deadline, on
    ModelInfer as on ModelStreamInfer: a longer one than the server's budget is served, a
    shorter one is refused."""
    server, _ = serve(seq_models, base_s=0.06, warmup_iterations=2)
    with server, server.channel() as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        generous, short = _seq_infer(1), _seq_infer(2)
        generous.parameters["timeout"].int64_param = 2_000_000  # 2 s: a 60 ms engine fits
        short.parameters["timeout"].int64_param = 1
        served = stub.ModelInfer(generous)  # no call deadline: the server budget, 10 ms, or 2 s
        with pytest.raises(grpc.RpcError) as late:
            stub.ModelInfer(short, timeout=10)
        streamed = list(stub.ModelStreamInfer(iter([generous, short]), timeout=10))
    assert np.isfinite(np.frombuffer(served.raw_output_contents[0], "<f4")).all()
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    by_id = {reply.infer_response.id or "r2": reply for reply in streamed}
    assert (
        by_id["r1"].infer_response.raw_output_contents and "deadline" in by_id["r2"].error_message
    )


def _try(stub, req, timeout):
    try:
        return stub.Score(req, timeout=timeout)
    except grpc.RpcError as exc:
        return exc


def test_full_queue_answers_resource_exhausted(seq_models):
    server, made = serve(
        seq_models,
        base_s=0.05,
        max_queue_rows=4,
        max_batch_size=2,
        budget_ms=10000,
        warmup_iterations=0,
    )
    with server, server.channel() as channel:
        made["seq-mini"].batches.clear()  # the load's probe of the output layout
        stub = pb_grpc.RiskScoringStub(channel)
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            outcomes = list(pool.map(lambda i: _try(stub, request(i), 10), range(24)))
    exhausted = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    served = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
    assert exhausted and served
    assert {e.code() for e in exhausted} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all(o.score == pytest.approx(want(int(o.request_id)), abs=1e-6) for o in served)
    # Everything admitted ran exactly once.
    assert sum(made["seq-mini"].batches) == len(served)


def test_engine_failure_is_internal_and_fans_out(seq_models):
    server, _ = serve(seq_models, fail=True, warmup_iterations=0, budget_ms=2000)
    with server, server.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(lambda i: _try(stub, request(i), 5), range(16)))
    assert all(isinstance(o, grpc.RpcError) for o in outcomes)
    assert {o.code() for o in outcomes} == {grpc.StatusCode.INTERNAL}
    assert all("injected" not in o.details() for o in outcomes)  # internal text stays inside


def test_a_long_history_waits_for_its_own_batch_instead_of_padding_short_ones():
    """Queued behind a busy engine: the short histories go together, the long one next."""
    release = threading.Event()
    shapes: list[tuple[int, int]] = []

    def run(rows: RowBatch) -> Scored:
        shapes.append((rows.rows, rows.history_length))
        release.wait(5)
        return Scored(np.arange(rows.rows, dtype=np.float32), "fake", "", 0.001)

    def rows_of(length: int) -> RowBatch:
        return RowBatch(
            np.zeros((1, 4), np.float32),
            np.ones((1, length, 3), np.float32),
            np.ones((1, length), np.float32),
        )

    async def scenario() -> list[float]:
        batcher = MicroBatcher(run, max_batch_rows=16, max_queue_rows=64, workers=1, inline_max_s=0)
        batcher.start()
        deadline = time.monotonic() + 5
        first = asyncio.create_task(batcher.submit(rows_of(8), deadline))
        await until(lambda: len(shapes) == 1, 5)  # the engine is now busy with the first batch
        queued = [
            asyncio.create_task(batcher.submit(rows_of(length), deadline + 0.1 * i))
            for i, length in enumerate((8, 64, 8, 8))
        ]
        await until(lambda: batcher.queued_rows == 4, 5)
        release.set()
        scores = [float(s.scores[0]) for s in await asyncio.gather(first, *queued)]
        await batcher.close(1.0)
        return scores

    scores = asyncio.run(scenario())
    assert shapes == [(1, 8), (3, 8), (1, 64)]
    # Each caller got its own row of its own batch: 0 for single-row batches, and rows 0, 1, 2
    # of the merged batch in deadline order for the three short ones.
    assert scores == [0.0, 0.0, 0.0, 1.0, 2.0]


def test_rows_against_one_history_run_as_a_batch_of_their_own():
    """An explained request's block against one history is never merged with other rows (that
    would compute its history once per row): the rows before it go together, it goes alone."""
    release = threading.Event()
    shapes: list[tuple[int, int]] = []

    def run(rows: RowBatch) -> Scored:
        shapes.append((rows.rows, int(rows.history.shape[0])))
        release.wait(5)
        return Scored(np.arange(rows.rows, dtype=np.float32), "fake", "", 0.001)

    def rows_of(n: int, histories: int) -> RowBatch:
        return RowBatch(
            np.zeros((n, 4), np.float32),
            np.ones((histories, 8, 3), np.float32),
            np.ones((histories, 8), np.float32),
        )

    async def scenario() -> list[list[float]]:
        batcher = MicroBatcher(run, max_batch_rows=16, max_queue_rows=64, workers=1, inline_max_s=0)
        batcher.start()
        deadline = time.monotonic() + 5
        first = asyncio.create_task(batcher.submit(rows_of(1, 1), deadline))
        await until(lambda: len(shapes) == 1, 5)  # the engine is now busy with the first batch
        queued = [
            asyncio.create_task(batcher.submit(rows, deadline + 0.1 * i))
            for i, rows in enumerate(
                (rows_of(1, 1), rows_of(1, 1), rows_of(3, 1), rows_of(1, 1), rows_of(1, 1))
            )
        ]
        await until(lambda: batcher.queued_rows == 7, 5)
        release.set()
        scored = await asyncio.gather(first, *queued)
        await batcher.close(1.0)
        return [s.scores.tolist() for s in scored]

    scores = asyncio.run(scenario())
    assert shapes == [(1, 1), (2, 2), (3, 1), (2, 2)]
    assert scores == [[0.0], [0.0], [1.0], [0.0, 1.0, 2.0], [0.0], [1.0]]


def test_the_parts_of_a_job_against_one_history_run_each_as_they_are():
    """An explained block's rows against one history and its rows with the history emptied:
    one job, run alone, each part an engine run of its own shape, the scores joined in order."""
    shapes: list[tuple[int, int, int]] = []

    def run(rows: RowBatch) -> Scored:
        shapes.append((rows.rows, int(rows.history.shape[0]), rows.history_length))
        offset = 10.0 * len(shapes)
        return Scored(offset + np.arange(rows.rows, dtype=np.float32), "fake", "", 0.001)

    shared = RowBatch(
        np.zeros((3, 4), np.float32), np.ones((1, 8, 3), np.float32), np.ones((1, 8), np.float32)
    )
    emptied = RowBatch(
        np.zeros((2, 4), np.float32), np.zeros((2, 1, 3), np.float32), np.zeros((2, 1), np.float32)
    )

    async def scenario() -> Scored:
        batcher = MicroBatcher(run, max_batch_rows=16, max_queue_rows=64, workers=1)
        batcher.start()
        scored = await batcher.submit([shared, emptied], time.monotonic() + 5)
        await batcher.close(1.0)
        return scored

    scored = asyncio.run(scenario())
    assert shapes == [(3, 1, 8), (2, 2, 1)]
    assert scored.scores.tolist() == [10.0, 11.0, 12.0, 20.0, 21.0]
    assert scored.batch_rows == 5 and scored.engine_s == pytest.approx(0.002)


@pytest.mark.parametrize("first_fell_back", [True, False])
def test_joined_runs_give_the_fallback_reason_to_the_rows_that_fell_back(first_fell_back):
    """Parts run one after another (an explained block and its emptied rows), one of them on
    the fallback engine: its rows, and only they, carry the reason, whichever part it was."""
    reason = "shape_mismatch: history too long"
    fell_back = Scored(np.zeros(3, np.float32), "onnxruntime-cpu", reason, 0.001, "fp32")
    preferred = Scored(np.ones(2, np.float32), "tensorrt-fp16", "", 0.001, "fp16")
    runs = [fell_back, preferred] if first_fell_back else [preferred, fell_back]
    joined = Scored.joined(runs)
    rows = [joined.row_engine(row) for row in range(5)]
    on_fallback = ("onnxruntime-cpu", reason)
    on_preferred = ("tensorrt-fp16", "")
    if first_fell_back:
        assert rows == [on_fallback] * 3 + [on_preferred] * 2
    else:
        assert rows == [on_preferred] * 2 + [on_fallback] * 3
    assert (joined.engine, joined.precision) == ("tensorrt-fp16", "fp16")


def test_calls_beyond_the_admission_limit_are_refused_at_once(seq_models):
    """More scoring calls in progress than the limit: the excess is RESOURCE_EXHAUSTED, named as
    such, and every call admitted is still scored."""
    server, made = serve(
        seq_models,
        base_s=0.05,
        max_requests_in_progress=3,
        budget_ms=10000,
        warmup_iterations=0,
    )
    with server, server.channel() as channel:
        made["seq-mini"].batches.clear()  # the load's probe of the output layout
        stub = pb_grpc.RiskScoringStub(channel)
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(lambda i: _try(stub, request(i), 10), range(12)))
    refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    served = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
    assert refused and served
    assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all("limit 3" in e.details() for e in refused)
    assert all(o.score == pytest.approx(want(int(o.request_id)), abs=1e-6) for o in served)
    assert sum(made["seq-mini"].batches) == len(served)


def test_a_close_that_fails_queued_jobs_leaves_the_queue_counted_empty():
    """Jobs still queued when the drain ends fail UNAVAILABLE, and the queue-depth gauge they
    feed (`queued_rows`) reads 0 after, not the rows they had."""
    release = threading.Event()

    def run(rows: RowBatch) -> Scored:
        release.wait(10)
        return Scored(np.zeros(rows.rows, np.float32), "fake", "", 0.0001)

    async def scenario() -> tuple[int, list[BaseException | Scored]]:
        batcher = MicroBatcher(run, max_batch_rows=1, max_queue_rows=64, workers=1, inline_max_s=0)
        batcher.start()
        rows = RowBatch(np.zeros((1, 4), np.float32), None, None)
        submitted = [
            asyncio.ensure_future(batcher.submit(rows, time.monotonic() + 60)) for _ in range(3)
        ]
        await until(lambda: batcher.queued_rows == 2, 5)  # one runs, two wait
        await batcher.close(0.01)
        release.set()
        outcomes = await asyncio.gather(*submitted, return_exceptions=True)
        return batcher.queued_rows, outcomes

    queued, outcomes = asyncio.run(scenario())
    assert queued == 0
    assert sum(isinstance(o, Unavailable) for o in outcomes) >= 2


def test_requests_whose_callers_went_away_no_longer_fill_the_queue():
    """Callers that give up (a deadline, a hang-up) while the engine is busy: their rows leave
    the queue's count at once, so a new request is queued, not refused as if it were full."""
    gate, busy = threading.Event(), threading.Event()

    def run(rows: RowBatch) -> Scored:
        busy.set()
        gate.wait(30)
        return Scored(np.zeros(rows.rows, np.float32), "e", "", 0.001)

    def row() -> RowBatch:
        return RowBatch(np.zeros((1, 4), np.float32), None, None)

    async def scenario() -> int:
        batcher = MicroBatcher(run, max_batch_rows=8, max_queue_rows=8, workers=1, inline_max_s=0.0)
        batcher.start()
        far = time.monotonic() + 60
        running = asyncio.create_task(batcher.submit(row(), far))  # holds the one worker
        await until(busy.is_set)
        gone = [asyncio.create_task(batcher.submit(row(), far)) for _ in range(8)]
        await until(lambda: batcher.queued_rows == 8)
        for caller in gone:
            caller.cancel()
        await asyncio.gather(*gone, return_exceptions=True)
        left = batcher.queued_rows
        admitted = asyncio.create_task(batcher.submit(row(), far))  # refused at once if full
        await until(lambda: batcher.queued_rows == 1 or admitted.done())
        gate.set()
        await asyncio.gather(running, admitted)  # both scored
        await batcher.close(1.0)
        return left

    assert asyncio.run(scenario()) == 0


def test_requests_refused_together_are_each_counted_as_shed():
    """Stream messages queued as one job (`requests`) and refused together: each is a request
    in riskserve_shed_total, as each is in riskserve_requests_total."""
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(
        Settings(metrics_port=None, trace_file=None, stats_interval_s=0), metric_readers=[reader]
    )

    def run(rows: RowBatch) -> Scored:
        return Scored(np.zeros(rows.rows, np.float32), "e", "", 0.05)

    async def scenario() -> None:
        batcher = MicroBatcher(
            run, max_batch_rows=16, max_queue_rows=64, workers=1, telemetry=telemetry
        )
        batcher.start()
        rows = RowBatch(np.zeros((5, 4), np.float32), None, None)
        await batcher.submit(rows, time.monotonic() + 10, requests=5)  # teaches 50 ms a run
        with pytest.raises(DeadlineMissed):
            await batcher.submit(rows, time.monotonic() + 0.001, requests=5)
        await batcher.close(1.0)

    try:
        asyncio.run(scenario())
        shed = [
            point.value
            for resource in reader.get_metrics_data().resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == "riskserve.shed"
            for point in metric.data.data_points
            if point.attributes.get("reason") == "deadline"
        ]
    finally:
        telemetry.shutdown()
    assert sum(shed) == 5
