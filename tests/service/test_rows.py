"""RowBatch: the one place histories are padded, and the engine inputs it names."""

from __future__ import annotations

import numpy as np
from liveserver import REPO

from engines.manifest import HistorySpec, load_manifest
from service.batching.rows import MAX_PADDING, RowBatch, length_groups

SPEC = HistorySpec(fields=("a", "b"), max_length=8, min_padded_length=3)


def _row(length: int, value: float) -> RowBatch:
    history = np.full((length, 2), value, dtype=np.float32)
    return RowBatch.single(np.full(4, value, dtype=np.float32), history, SPEC)


def test_a_single_row_is_padded_only_to_the_models_minimum():
    long = _row(5, 1.0)
    assert long.history.shape == (1, 5, 2) and long.mask.tolist() == [[1.0] * 5]
    short = _row(1, 2.0)
    assert short.history.shape == (1, 3, 2)
    assert short.mask.tolist() == [[1.0, 0.0, 0.0]]
    assert short.history[0, 1:].sum() == 0.0
    empty = _row(0, 3.0)
    assert empty.history.shape == (1, 3, 2) and empty.mask.sum() == 0.0


def test_concat_pads_every_history_to_the_longest_and_keeps_row_order():
    merged = RowBatch.concat([_row(5, 1.0), _row(1, 2.0), _row(4, 3.0)])
    assert merged.rows == 3 and merged.history_length == 5
    assert merged.features[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert merged.mask.sum(axis=1).tolist() == [5.0, 1.0, 4.0]
    # Padding is zeros after each row's own length; the real rows keep their values.
    assert merged.history[1, 0].tolist() == [2.0, 2.0] and merged.history[1, 1:].sum() == 0.0
    assert merged.history[2, :4].min() == 3.0 and merged.history[2, 4].sum() == 0.0


def test_one_complete_part_is_passed_through_without_a_copy():
    part = _row(5, 1.0)
    assert RowBatch.concat([part]) is part


def test_feed_names_the_models_inputs():
    manifest = load_manifest(REPO / "models" / "fraud-demo" / "1")
    demo = RowBatch(
        np.zeros((2, manifest.n_features), np.float32),
        np.zeros((2, 3, len(manifest.history.fields)), np.float32),
        np.ones((2, 3), np.float32),
    )
    feed = demo.feed(manifest)
    assert set(feed) == {
        manifest.features_input,
        manifest.history.input,
        manifest.history.mask_input,
    }
    assert feed[manifest.history.input] is demo.history


def test_rows_against_one_history_count_it_once_and_repeat_it_when_merged():
    shared = RowBatch(
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.full((1, 5, 2), 7.0, np.float32),
        np.ones((1, 5), np.float32),
    )
    assert shared.shares_history and shared.cells == 5 + 2
    own = _row(5, 1.0)
    assert not own.shares_history and own.cells == 5
    assert RowBatch.concat([shared]) is shared  # alone, it goes to the engine as it is
    merged = RowBatch.concat([_row(2, 1.0), shared])
    assert merged.rows == 4 and merged.history.shape == (4, 5, 2)
    assert (merged.history[1:] == 7.0).all() and merged.mask[1:].sum() == 3 * 5
    assert merged.features[1:].tolist() == shared.features.tolist()


def test_history_lengths_end_at_each_rows_last_real_history_row():
    merged = RowBatch.concat([_row(5, 1.0), _row(1, 2.0), _row(4, 3.0)])
    assert merged.history_lengths().tolist() == [5, 1, 4]
    # A row with no real history row (emptied for an explanation) keeps its padded length.
    emptied = RowBatch(merged.features, merged.history, merged.mask * np.array([[1], [0], [1]]))
    assert emptied.history_lengths().tolist() == [5, 5, 4]
    assert RowBatch(merged.features, None, None).history_lengths().tolist() == [0, 0, 0]


def test_take_cuts_the_histories_to_the_rows_taken():
    merged = RowBatch.concat([_row(5, 1.0), _row(1, 2.0), _row(4, 3.0)])
    short = merged.take(np.array([1, 2]), 4)
    assert short.history.shape == (2, 4, 2) and short.mask.sum(axis=1).tolist() == [1.0, 4.0]
    assert short.features[:, 0].tolist() == [2.0, 3.0]
    wider = merged.take(np.array([1]), 7)  # padded, never cut below a row's own length
    assert wider.history.shape == (1, 7, 2) and wider.mask.tolist() == [[1.0] + [0.0] * 6]


def test_length_groups_bound_padding_and_rows_as_the_batcher_does():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(4, 65, size=200), rng.integers(65, 201, size=20)])
    groups = length_groups(lengths, max_rows=64)
    assert sorted(np.concatenate(groups).tolist()) == list(range(220))  # each row once
    for group in groups:
        own = lengths[group]
        assert len(group) <= 64
        if len(group) > 1:
            assert len(group) * own.max() <= MAX_PADDING * own.sum()
    # A long history does not make the short ones wait for its length: far fewer cells are
    # computed than padding every row to the longest.
    padded = sum(len(g) * lengths[g].max() for g in groups)
    assert padded <= MAX_PADDING * lengths.sum() < 0.5 * len(lengths) * lengths.max()
    assert length_groups(np.zeros(0, dtype=np.intp), 8) == []
