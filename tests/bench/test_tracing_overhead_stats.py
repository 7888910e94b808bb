"""The tracing benchmark's statistics: its two-level bootstrap and its turn-taking schedule."""

from __future__ import annotations

import numpy as np

from bench.tracing_overhead import _taking_turns, block_bootstrap


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
