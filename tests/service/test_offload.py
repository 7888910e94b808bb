"""Short batches run on the event loop while calls come one at a time, and on an engine thread
while they overlap, so that the calls arriving meanwhile make the next batch."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from liveserver import server_process
from modelkit import write_sequence_model

import service.batching.batcher as batcher_module
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.batching.batcher import MicroBatcher, Scored
from service.batching.rows import RowBatch

LOOP, THREAD = "loop", "thread"


class _Engine:
    """Records where each batch ran and its rows; a run on a thread can be held until let go."""

    def __init__(self, hold: bool = False) -> None:
        self.runs: list[tuple[str, int]] = []
        self.hold = hold
        self.entered = threading.Semaphore(0)
        self.go = threading.Semaphore(0)
        self._loop_thread = threading.current_thread()

    def __call__(self, rows: RowBatch) -> Scored:
        where = LOOP if threading.current_thread() is self._loop_thread else THREAD
        self.runs.append((where, rows.rows))
        if where == THREAD and self.hold:
            self.entered.release()
            assert self.go.acquire(timeout=10), "the test never let the run go"
        return Scored(np.zeros(rows.rows, np.float32), "fake", "", 0.0001)


def _row() -> RowBatch:
    return RowBatch(np.zeros((1, 4), np.float32), None, None)


def _batcher(engine: _Engine, max_batch_rows: int = 16) -> MicroBatcher:
    return MicroBatcher(engine, max_batch_rows=max_batch_rows, max_queue_rows=64, workers=1)


def _submit(batcher: MicroBatcher) -> asyncio.Task[Scored]:
    return asyncio.create_task(batcher.submit(_row(), time.monotonic() + 60))


async def _entered(engine: _Engine) -> None:
    """Wait until a held run has started on its thread."""
    await asyncio.to_thread(lambda: engine.entered.acquire(timeout=10))


async def _overlapping_round(batcher: MicroBatcher, engine: _Engine, company: int) -> None:
    """One batch held on its thread while `company` more requests arrive, then both batches."""
    first = _submit(batcher)
    await _entered(engine)
    joined = [_submit(batcher) for _ in range(company)]
    for _ in range(3):
        await asyncio.sleep(0)  # the requests reach the queue
    engine.go.release()
    await first
    await _entered(engine)  # the arrivals run together, on a thread again
    engine.go.release()
    await asyncio.gather(*joined)


def test_one_caller_runs_on_the_event_loop_but_for_a_probe_now_and_then():
    async def runs() -> list[tuple[str, int]]:
        engine = _Engine()
        batcher = _batcher(engine)
        batcher.start()
        for _ in range(2 * batcher_module._OFFLOAD_PROBE_EVERY):
            await _submit(batcher)
        await batcher.close(1.0)
        return engine.runs

    every = batcher_module._OFFLOAD_PROBE_EVERY
    alone = [(LOOP, 1)] * (every - 1) + [(THREAD, 1)]
    assert asyncio.run(runs()) == alone * 2


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names: Linux only")
def test_an_engine_thread_carries_its_name_where_the_os_shows_it(monkeypatch):
    """`top -H`, /proc and profilers tell an engine thread from gRPC's by its name."""
    names: list[str] = []

    def engine(rows: RowBatch) -> Scored:
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        names.append(comm.read_text().strip())
        return Scored(np.zeros(rows.rows, np.float32), "fake", "", 0.0001)

    async def run() -> None:
        batcher = MicroBatcher(
            engine, max_batch_rows=4, max_queue_rows=8, workers=1, labels=("fraud", "3")
        )
        batcher.start()
        monkeypatch.setattr(batcher_module, "_OFFLOAD_PROBE_EVERY", 1)  # run it on the thread
        await batcher.submit(_row(), time.monotonic() + 60)
        await batcher.close(1.0)

    asyncio.run(run())
    assert names == ["engine-fraud-3-"], names  # "engine-fraud-3-0", cut to the OS's 15 bytes


def test_overlapping_calls_move_short_batches_to_a_thread_until_they_stop(monkeypatch):
    async def runs() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        engine = _Engine(hold=True)
        batcher = _batcher(engine)
        batcher.start()
        # Every short batch probes a thread at first: three rounds of overlapping calls.
        monkeypatch.setattr(batcher_module, "_OFFLOAD_PROBE_EVERY", 1)
        for _ in range(3):
            await _overlapping_round(batcher, engine, company=3)
        overlapped = list(engine.runs)
        # No more probes: batches stay on a thread while calls overlap...
        monkeypatch.setattr(batcher_module, "_OFFLOAD_PROBE_EVERY", 10**9)
        engine.runs.clear()
        await _overlapping_round(batcher, engine, company=2)
        # ...and come back to the loop once a few runs on a thread have had no company.
        engine.hold = False
        for _ in range(16):
            await _submit(batcher)
        await batcher.close(1.0)
        return overlapped, engine.runs

    overlapped, after = asyncio.run(runs())
    assert overlapped == [(THREAD, 1), (THREAD, 3)] * 3
    assert after[:2] == [(THREAD, 1), (THREAD, 2)]
    lone = after[2:]
    assert lone[0] == (THREAD, 1)
    assert lone[-1] == (LOOP, 1)
    back = lone.index((LOOP, 1))
    assert set(lone[back:]) == {(LOOP, 1)}, "a lone caller went back to a thread"


def test_one_extra_arrival_does_not_count_as_company(monkeypatch):
    """Two callers alternate batches of one: a thread hop each would only cost them."""

    async def worth() -> float:
        engine = _Engine(hold=True)
        batcher = _batcher(engine)
        batcher.start()
        monkeypatch.setattr(batcher_module, "_OFFLOAD_PROBE_EVERY", 1)
        for _ in range(4):
            first = _submit(batcher)
            await _entered(engine)
            second = _submit(batcher)
            for _ in range(3):
                await asyncio.sleep(0)
            engine.go.release()
            await first
            await _entered(engine)
            engine.go.release()
            await second
        await batcher.close(1.0)
        assert engine.runs == [(THREAD, 1)] * 8
        return batcher._offload.worth if batcher._offload is not None else -1.0

    assert asyncio.run(worth()) == 0.0


def test_batches_of_one_row_stay_on_the_event_loop(monkeypatch):
    async def runs() -> list[tuple[str, int]]:
        engine = _Engine()
        batcher = _batcher(engine, max_batch_rows=1)
        batcher.start()
        monkeypatch.setattr(batcher_module, "_OFFLOAD_PROBE_EVERY", 1)
        await asyncio.gather(*[_submit(batcher) for _ in range(8)])
        await batcher.close(1.0)
        return engine.runs

    assert asyncio.run(runs()) == [(LOOP, 1)] * 8


@pytest.fixture(scope="module")
def seq_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("seq")
    write_sequence_model(root)
    return root


# One call in ten. With the server in a process of its own and short batches moved to a thread,
# 146 to 375 of 640 calls shared a batch in eight runs on a two-core machine, four of them with
# both cores kept busy by other processes; the deterministic tests above show that the
# batches are the offload's doing.
_SHARED = 64
_ROUNDS = 4


def _shared_batches(target: str, callers: int, calls: int) -> int:
    """Replies, of `callers` threads making `calls` Score calls each one after another, that
    were scored in a batch with another call's rows; each reply must carry its own id."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RiskScoringStub(channel)

        def caller(first: int) -> int:
            shared = 0
            for i in range(first, first + calls):
                reply = stub.Score(
                    pb.ScoreRequest(
                        request_id=str(i),
                        features={f"x{j}": 0.5 for j in range(4)},
                        history=[pb.HistoryRow(values=[0.1, 1.0, -1.0])],
                    ),
                    timeout=10,
                )
                assert reply.request_id == str(i)
                shared += reply.timings.batch_size > 1
            return shared

        with concurrent.futures.ThreadPoolExecutor(callers) as pool:
            return sum(pool.map(caller, range(0, callers * calls, calls)))


def test_concurrent_unary_callers_share_batches(seq_models):
    """16 callers, each one call at a time, on an ONNX Runtime model fast enough to run on the
    event loop: one in ten or more of their calls are scored in batches with others'. A round
    of calls on a machine busy with other work may see less: up to four rounds are made."""
    env = {
        "RISKSERVE_DEFAULT_MODEL": "seq-mini",
        "RISKSERVE_BUDGET_MS": "5000",
        "RISKSERVE_MAX_BATCH_SIZE": "16",
    }
    rounds = []
    with server_process(seq_models, **env) as (_, target):
        while len(rounds) < _ROUNDS and (not rounds or rounds[-1] <= _SHARED):
            rounds.append(_shared_batches(target, callers=16, calls=40))
    assert rounds[-1] > _SHARED, f"calls of 640 that shared a batch, by round: {rounds}"
