"""bench.explain's models: the demo's codes make 15-row blocks, one code per feature 33."""

from __future__ import annotations

from bench.explain import _models
from engines.manifest import load_manifest
from service.explanations.occlusion import Explainer


def test_block_sizes_of_the_benchmarked_manifests(tmp_path):
    demo = load_manifest(_models(tmp_path / "demo", per_feature=False) / "fraud-demo" / "1")
    per_feature = load_manifest(_models(tmp_path / "each", per_feature=True) / "fraud-demo" / "1")
    assert Explainer(demo).block_rows == 15
    assert Explainer(per_feature).block_rows == 33
    assert all(len(c.features) == 1 for c in per_feature.reason_codes if not c.history)


def test_the_repeated_configuration_turns_the_broadcast_off(tmp_path):
    shared = load_manifest(_models(tmp_path / "each", per_feature=True) / "fraud-demo" / "1")
    repeated = load_manifest(
        _models(tmp_path / "repeated", per_feature=True, broadcast=False) / "fraud-demo" / "1"
    )
    assert shared.history is not None and shared.history.broadcast
    assert repeated.history is not None and not repeated.history.broadcast
    assert Explainer(repeated).block_rows == Explainer(shared).block_rows == 33
