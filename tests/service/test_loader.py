"""The batch cap: the largest optimization profile, never more than the setting."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeEngine
from liveserver import REPO
from modelkit import write_sequence_model

from engines.manifest import ProfileSpec, load_manifest
from service.batching.rows import RowBatch
from service.errors import Unavailable
from service.models.loader import VersionLoader, batch_cap, default_engines

DEMO = load_manifest(REPO / "models" / "fraud-demo" / "1")


def test_the_largest_engine_profile_caps_the_batch():
    engines = [FakeEngine(DEMO, max_rows=16), FakeEngine(DEMO, max_rows=32)]
    assert batch_cap(64, DEMO, engines) == 32
    assert batch_cap(8, DEMO, engines) == 8


def test_without_engine_profiles_the_manifest_profiles_cap_the_batch():
    # The demo declares TensorRT profiles up to 64 rows; ONNX Runtime accepts any batch.
    largest = max(p.batch[2] for specs in DEMO.profiles.values() for p in specs)
    assert batch_cap(1024, DEMO, []) == largest
    bare = DEMO.model_copy(update={"profiles": {}})
    assert batch_cap(1024, bare, []) == 1024
    small = DEMO.model_copy(update={"profiles": {"fp16": (ProfileSpec(batch=(1, 4, 12)),)}})
    assert batch_cap(1024, small, []) == 12


def _loader() -> VersionLoader:
    return VersionLoader(
        default_engines(1, 1, tensorrt=False, onnx_variants=False),
        max_batch_rows=16,
        max_queue_rows=64,
        workers=1,
        max_queue_delay_s=0.0,
        warmup_iterations=0,
        degrade_on_deadline=False,
    )


def test_a_declared_history_broadcast_is_checked_at_load(tmp_path):
    """`history.broadcast` on a model whose graph joins history and features by Concat (the
    batches must match) is refused, naming the setting; the same score by Add loads and scores
    three rows against one history as against it repeated."""
    with pytest.raises(Unavailable, match=r"declares history\.broadcast, but engine"):
        _loader().build(
            write_sequence_model(tmp_path, name="seq-cat", join="concat", broadcast=True)
        )
    model = _loader().build(write_sequence_model(tmp_path, name="seq-add", broadcast=True))
    rng = np.random.default_rng(3)
    features = rng.normal(size=(3, 4)).astype(np.float32)
    history = rng.normal(size=(1, 5, 3)).astype(np.float32)
    mask = np.ones((1, 5), np.float32)
    shared = model.batcher.run_batch(RowBatch(features, history, mask))
    repeated = model.batcher.run_batch(
        RowBatch(features, np.repeat(history, 3, axis=0), np.repeat(mask, 3, axis=0))
    )
    np.testing.assert_allclose(shared.scores, repeated.scores, rtol=1e-6)


def test_the_demo_model_broadcasts_its_history():
    assert DEMO.history is not None and DEMO.history.broadcast
