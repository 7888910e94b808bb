"""The batch cap: the largest optimization profile, never more than the setting."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from fakes import FakeEngine
from liveserver import REPO
from loaders import small_loader
from modelkit import add_validated_variants, write_sequence_model, write_tabular_model
from pydantic import ValidationError

from engines.manifest import ProfileSpec, load_manifest
from engines.onnxrt import OnnxRuntimeEngine
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


def _loader(onnx_variants: bool = False) -> VersionLoader:
    return small_loader(default_engines(1, 1, tensorrt=False, onnx_variants=onnx_variants))


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


class _ShapeRecorder(FakeEngine):
    """Records (feature rows, history rows, history length) of every batch it runs."""

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        self.shapes: list[tuple[int, ...]] = []

    def _infer(self, inputs, profile):
        history = inputs["history"]
        self.shapes.append((len(inputs["features"]), *history.shape[:2]))
        return super()._infer(inputs, profile)


@pytest.mark.parametrize(
    ("max_rows", "max_history", "probed"),
    [(64, 16, (3, 16)), (2, 64, (2, 32)), (1, 64, None)],
    ids=["history-to-16", "batch-to-2", "batch-of-1"],
)
def test_the_broadcast_probe_fits_each_engines_profile(tmp_path, max_rows, max_history, probed):
    """A TensorRT-like engine whose profile is narrower than the probe's usual 3 rows and 32
    history rows is probed inside its profile, or, where it never gets a shared history (one
    row at a time), not at all; either way the version loads."""
    path = write_sequence_model(tmp_path, name="seq-add", broadcast=True, max_length=64)
    made = []

    def factory(path, manifest, score):
        fallback = OnnxRuntimeEngine.from_model_dir(path, manifest, score=score)
        fast = _ShapeRecorder(
            manifest, name="tensorrt-fp16", max_rows=max_rows, max_history=max_history
        )
        made.append(fast)
        return [fast, fallback], fallback

    loader = small_loader(factory)
    model = loader.build(path)
    assert "tensorrt-fp16" in {e.name for e in model.pool.engines}
    shared = [s for s in made[0].shapes if s[0] > 1 and s[1] == 1]
    if probed is None:
        assert shared == []
    else:
        rows, length = probed
        assert shared == [(rows, 1, length)]
        assert (rows, rows, length) in made[0].shapes


def test_the_demo_model_broadcasts_its_history():
    assert DEMO.history is not None and DEMO.history.broadcast


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and "validation.json" in r.getMessage()
    ]


def test_validated_variants_load_beside_fp32(tmp_path, caplog):
    version = write_tabular_model(tmp_path, version="1")
    add_validated_variants(version)
    engines = {e.name for e in _loader(onnx_variants=True).build(version).pool.engines}
    assert engines == {"onnxruntime-cpu", "onnxruntime-cpu-fp16", "onnxruntime-cpu-int8"}
    assert _refusals(caplog) == []


def test_a_version_copied_with_another_versions_report_loads_fp32_and_warns(tmp_path, caplog):
    """A new version made by copying the last one, `validation.json` and variants included:
    the report vouches for version 1, so version 2 serves from FP32 alone, and one WARNING
    names the report and why."""
    add_validated_variants(write_tabular_model(tmp_path, version="1"))
    copied = shutil.copytree(tmp_path / "credit-lite" / "1", tmp_path / "credit-lite" / "2")
    manifest = json.loads((copied / "manifest.json").read_text())
    (copied / "manifest.json").write_text(json.dumps({**manifest, "version": "2"}))
    model = _loader(onnx_variants=True).build(copied)
    assert model.pool.engines == () and model.pool.fallback.name == "onnxruntime-cpu"
    (warning,) = _refusals(caplog)
    assert str(copied / "validation.json") in warning
    assert "the report is for credit-lite version 1, not credit-lite version 2" in warning
    assert f"riskserve validate {copied}" in warning


def test_a_manifest_value_that_cannot_work_refuses_the_version_naming_it(tmp_path):
    version = write_tabular_model(tmp_path, version="1")
    manifest = json.loads((version / "manifest.json").read_text())
    manifest["explanations"] = {
        "features": {"f2": {"baseline": float("nan"), "code": "F2", "text": "f2 is high"}}
    }
    (version / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValidationError, match=r"explanations\.features\['f2'\]\.baseline"):
        _loader().build(version)
