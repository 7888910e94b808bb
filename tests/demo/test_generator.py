"""The synthetic transaction process: determinism, shapes, and where the fraud signal lives."""

from __future__ import annotations

import numpy as np
import pytest

from demo.generator import (
    FEATURE_NAMES,
    HISTORY_FIELDS,
    DemoData,
    generate,
    model_inputs,
    pad_histories,
)

_H = {name: i for i, name in enumerate(HISTORY_FIELDS)}
_F = {name: i for i, name in enumerate(FEATURE_NAMES)}


@pytest.fixture(scope="module")
def data() -> DemoData:
    return generate(8000, seed=31337)


def test_same_seed_same_data_other_seed_other_data() -> None:
    a, b, c = generate(500, seed=7), generate(500, seed=7), generate(500, seed=8)
    assert a.entity_ids == b.entity_ids
    np.testing.assert_array_equal(a.features, b.features)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert all(np.array_equal(x, y) for x, y in zip(a.histories, b.histories, strict=True))
    assert a.entity_ids != c.entity_ids
    assert not np.array_equal(a.features, c.features)


def test_shapes_and_types(data: DemoData) -> None:
    n = len(data.labels)
    assert len(FEATURE_NAMES) == len(set(FEATURE_NAMES)) >= 28
    assert len(HISTORY_FIELDS) == 8
    assert data.features.shape == (n, len(FEATURE_NAMES))
    assert data.features.dtype == np.float32 and data.labels.dtype == np.int8
    assert len(data.entity_ids) == len(set(data.entity_ids)) == len(data.histories) == n
    assert all(
        h.dtype == np.float32 and h.shape[1:] == (len(HISTORY_FIELDS),) for h in data.histories
    )
    assert np.isfinite(data.features).all()
    assert all(np.isfinite(h).all() for h in data.histories)
    assert set(np.unique(data.labels)) == {0, 1}


def test_history_lengths_mostly_short_some_long(data: DemoData) -> None:
    lengths = np.array([len(h) for h in data.histories])
    assert lengths.min() >= 0 and lengths.max() <= 200
    assert np.mean((lengths >= 4) & (lengths <= 64)) > 0.9
    assert 0.02 < np.mean(lengths > 64) < 0.07
    assert np.any(lengths == 0)


def test_fraud_rate_in_range(data: DemoData) -> None:
    assert 0.03 <= data.labels.mean() <= 0.06


def _recent_burst_rows(history: np.ndarray) -> int:
    recent = history[-12:]
    tiny = np.exp(recent[:, _H["log_amount"]]) < 6.0
    quick = recent[:, _H["hours_since_prev"]] < 0.25
    return int(np.sum(tiny & quick))


def test_fraud_shows_in_the_sequence(data: DemoData) -> None:
    bursts = np.array([_recent_burst_rows(h) for h in data.histories])
    fraud = data.labels == 1
    assert bursts[fraud].mean() > 5 * bursts[~fraud].mean()
    assert np.mean(bursts[fraud] >= 3) > 0.2
    assert np.mean(bursts[~fraud] >= 3) < 0.02


def test_fraud_amount_jumps_above_own_history(data: DemoData) -> None:
    has = np.array([len(h) >= 4 for h in data.histories])
    hist_mean = np.array([h[:, _H["log_amount"]].mean() if len(h) else 0.0 for h in data.histories])
    jump = data.features[:, _F["log_amount"]] - hist_mean
    fraud = data.labels == 1
    assert np.median(jump[fraud & has]) > np.median(jump[~fraud & has]) + 1.0


def test_pad_histories_pads_at_the_end_with_a_mask() -> None:
    rows = [
        np.ones((3, 8), np.float32),
        np.zeros((0, 8), np.float32),
        2 * np.ones((1, 8), np.float32),
    ]
    history, mask = pad_histories(rows)
    assert history.shape == (3, 3, 8) and mask.shape == (3, 3)
    assert history.dtype == mask.dtype == np.float32
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 0], [1, 0, 0]])
    assert (history[1] == 0).all() and (history[2, 0] == 2).all() and (history[2, 1:] == 0).all()
    history, mask = pad_histories(rows, min_length=5)
    assert history.shape == (3, 5, 8) and mask[:, 3:].sum() == 0


def test_pad_histories_of_empty_histories_is_at_least_one_row() -> None:
    history, mask = pad_histories([np.zeros((0, 8), np.float32)])
    assert history.shape == (1, 1, 8) and mask.shape == (1, 1) and mask.sum() == 0


def test_model_inputs_names_and_shapes(data: DemoData) -> None:
    inputs = model_inputs(generate(10, seed=3))
    assert set(inputs) == {"features", "history", "history_mask"}
    n, t, h = inputs["history"].shape
    assert (n, h) == (10, len(HISTORY_FIELDS)) and inputs["history_mask"].shape == (n, t)
    assert inputs["features"].shape == (10, len(FEATURE_NAMES))


def test_the_demo_manifest_declares_the_generators_ranges_and_they_hold() -> None:
    from liveserver import REPO

    from demo.generator import FEATURE_RANGES
    from engines.manifest import load_manifest

    manifest = load_manifest(REPO / "models" / "fraud-demo" / "1")
    assert {k: tuple(v) for k, v in manifest.feature_ranges.items()} == FEATURE_RANGES
    bounds = manifest.feature_bounds
    assert bounds is not None
    features = generate(200_000, seed=2).features
    outside = (features < bounds.low) | (features > bounds.high)
    assert not outside.any(), [FEATURE_NAMES[c] for c in np.argwhere(outside)[:, 1]]
