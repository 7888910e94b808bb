"""The tracing benchmark's statistics: its two-level bootstrap, its turn-taking schedule, and
the runs it keeps (--save) and pools (--pool); that its in-process part runs, and what the
tracing-on server is given."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from bench.tracing_overhead import (
    Legs,
    _taking_turns,
    _tracing_env,
    block_bootstrap,
    recording,
)


def _instants(legs: int, blocks: int, per_block: int) -> tuple[np.ndarray, np.ndarray]:
    leg = np.repeat(np.arange(legs), blocks * per_block)
    block = np.tile(np.repeat(np.arange(blocks), per_block), legs)
    return leg, block


def test_bootstrap_finds_a_shift_and_brackets_it():
    legs, blocks = _instants(4, 10, 50)
    rng = np.random.default_rng(0)
    b = rng.exponential(0.002, len(legs))
    a = b + 0.0005  # every request half a millisecond slower
    diff, low, high = block_bootstrap(legs, blocks, a, b, 99, resamples=200)
    assert abs(diff - 0.5) < 1e-9
    assert low <= diff <= high
    # Paired instants: the shift is exact in every resample.
    assert abs(low - 0.5) < 1e-9 and abs(high - 0.5) < 1e-9


def test_bootstrap_skips_instants_a_side_was_not_sent():
    legs, blocks = _instants(2, 6, 20)
    values = np.linspace(0.001, 0.003, len(legs))
    a = np.where(np.arange(len(legs)) % 2 == 0, values, np.nan)
    b = np.where(np.arange(len(legs)) % 2 == 1, values, np.nan)
    diff, low, high = block_bootstrap(legs, blocks, a, b, 50, resamples=200)
    assert np.isfinite([diff, low, high]).all()
    assert low <= diff <= high


def test_bootstrap_counts_a_failed_request_as_slowest():
    legs, blocks = _instants(1, 4, 25)
    b = np.full(len(legs), 0.001)
    a = b.copy()
    a[3] = np.inf
    diff, _, _ = block_bootstrap(legs, blocks, a, b, 100, resamples=50)
    assert diff == np.inf


def test_turns_give_each_server_one_slot_a_round():
    labels = ["on", "off", "off-2"]
    offsets = np.arange(0.0, 60.0, 0.01)
    sends, rounds = _taking_turns(labels, slot_s=2.0)(0, offsets)
    assert all(len(send) == 1 for send in sends)
    slots = (offsets // 2.0).astype(int)
    for slot in np.unique(slots):
        held = {sends[i][0] for i in np.flatnonzero(slots == slot)}
        assert len(held) == 1  # a slot belongs to one server
    for r in np.unique(rounds):
        served = [sends[i][0] for i in np.flatnonzero(rounds == r)]
        assert set(served) == set(labels)
        assert all(served.count(label) == 200 for label in labels)  # 2 s at 100 instants/s
    first_orders = {
        tuple(dict.fromkeys(sends[i][0] for i in np.flatnonzero(rounds == r))) for r in range(10)
    }
    assert len(first_orders) > 1  # the order is drawn afresh, not fixed


SETTINGS = {"part": "servers taking turns", "slot_s": 2.0, "rate_rps": 150.0, "export": True}


def _run(legs: int, shift_s: float, seed: int, control: bool = True) -> Legs:
    leg, block = _instants(legs, 5, 40)
    rng = np.random.default_rng(seed)
    off = rng.exponential(0.002, len(leg))
    latencies = {"on": off + shift_s, "off": off}
    if control:
        latencies["off-2"] = np.where(np.arange(len(leg)) % 3 == 0, np.nan, off)
    latencies["on"][5] = np.inf
    return Legs(
        legs=leg,
        blocks=block,
        latencies=latencies,
        failed={label: {"DEADLINE_EXCEEDED": 1} if label == "on" else {} for label in latencies},
        cpu_s=dict.fromkeys(latencies, 2.0),
        took_s=30.0,
        kept_traces=12,
        settings=dict(SETTINGS),
        seeds=[seed],
    )


def test_a_saved_run_loads_as_it_was(tmp_path: Path):
    run = _run(3, 0.0002, seed=1)
    run.save(tmp_path / "run.npz")
    back = Legs.load(tmp_path / "run.npz")
    assert np.array_equal(back.legs, run.legs) and np.array_equal(back.blocks, run.blocks)
    assert list(back.latencies) == ["on", "off", "off-2"]
    for label, lat in run.latencies.items():
        assert np.array_equal(back.latencies[label], lat, equal_nan=True)  # NaN and inf kept
    assert back.failed == run.failed and back.cpu_s == run.cpu_s
    assert (back.took_s, back.kept_traces) == (30.0, 12)
    assert back.settings == SETTINGS and back.seeds == [1]


def test_pooled_runs_keep_their_legs_apart_and_share_their_servers():
    first, second = _run(3, 0.0002, seed=1), _run(2, 0.0004, seed=2, control=False)
    pooled = Legs.pooled([first, second])
    # The second run's legs come after the first's: five legs, not three.
    assert sorted(np.unique(pooled.legs)) == [0, 1, 2, 3, 4]
    assert np.array_equal(pooled.legs[len(first.legs) :], second.legs + 3)
    assert list(pooled.latencies) == ["on", "off"]  # off-2 ran in one of them only
    assert len(pooled.latencies["on"]) == len(first.legs) + len(second.legs)
    assert pooled.failed["on"] == {"DEADLINE_EXCEEDED": 2}
    assert pooled.cpu_s["off"] == 4.0 and pooled.took_s == 60.0 and pooled.kept_traces == 24
    assert pooled.seeds == [1, 2] and pooled.settings == SETTINGS
    # The pooled p50 shift lies between the two runs' own.
    diff, low, high = block_bootstrap(
        pooled.legs, pooled.blocks, pooled.latencies["on"], pooled.latencies["off"], 50, 100
    )
    assert 0.2 - 1e-9 <= diff <= 0.4 + 1e-9 and low <= diff <= high


def test_bootstrap_leaves_out_resamples_that_drew_one_side_only():
    # One leg of two rounds, the second a short one that only "off" was sent in.
    legs = np.zeros(300, dtype=np.int64)
    blocks = np.repeat([0, 1], [200, 100])
    off = np.full(300, 0.002)
    on = np.where(np.arange(300) < 100, 0.0025, np.nan)
    off[:100] = np.nan
    diff, low, high = block_bootstrap(legs, blocks, on, off, 50, resamples=200)
    assert abs(diff - 0.5) < 1e-9
    assert abs(low - 0.5) < 1e-9 and abs(high - 0.5) < 1e-9


def test_runs_made_with_other_settings_are_not_pooled():
    deployed, other = _run(2, 0.0, seed=1), _run(2, 0.0, seed=2)
    other.settings["export"] = False  # its traced server wrote nothing
    with pytest.raises(ValueError, match="different settings"):
        Legs.pooled([deployed, other])


def test_one_run_given_twice_is_not_pooled():
    run = _run(2, 0.0, seed=1)
    with pytest.raises(ValueError, match="seed comes twice"):
        Legs.pooled([run, run])


def test_the_recording_part_times_every_way_it_names():
    costs = recording(requests=64, repeats=1)
    assert set(costs) == {
        "riskserve tracing, ratio 0.01 (deployed)",
        "riskserve tracing, every trace exported",
        "SDK spans, 2 per request, all exported",
        "ratio 0.01, caches cold",
        "every trace exported, caches cold",
        "JSON lines, a kept request's spans written",
    }
    assert all(0 < seconds < 0.01 for seconds in costs.values())


def test_the_tracing_on_server_gets_only_the_settings_given(tmp_path: Path):
    args = argparse.Namespace(sample_ratio=None, export_batch=None)
    assert _tracing_env(args, None) == {}
    args = argparse.Namespace(sample_ratio=1.0, export_batch=64)
    assert _tracing_env(args, tmp_path / "t.jsonl") == {
        "RISKSERVE_TRACE_FILE": str(tmp_path / "t.jsonl"),
        "RISKSERVE_TRACE_SAMPLE_RATIO": "1",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64",
    }
