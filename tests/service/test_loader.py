"""The batch cap: the largest optimization profile, never more than the setting."""

from __future__ import annotations

from fakes import FakeEngine
from liveserver import REPO

from engines.manifest import ProfileSpec, load_manifest
from service.models.loader import batch_cap

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
