"""Real TensorRT engines for the demo model, compared with ONNX Runtime on the same rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engines.base import ShapeMismatch
from engines.manifest import load_manifest
from engines.onnxrt import OnnxRuntimeEngine
from engines.pool import EnginePool

pytestmark = pytest.mark.gpu

# Largest score difference against ONNX Runtime on the same ONNX file.
LIMITS = {"fp16": 0.01, "int8": 0.05}


def _inputs(n: int, seed: int) -> dict[str, np.ndarray]:
    from demo.generator import generate, model_inputs

    return model_inputs(generate(n, seed))


@pytest.fixture(scope="module")
def engines(demo_dir: Path):
    from engines.trt import build_engines, load_engines

    manifest = load_manifest(demo_dir)
    build_engines(demo_dir, ["fp16", "int8"], contexts=2)
    accepted = {"fp32": demo_dir / "model.onnx"}
    accepted |= {p: demo_dir / f for p, f in manifest.variants.items()}
    loaded = {e.precision: e for e in load_engines(demo_dir, accepted, ["fp16", "int8"])}
    yield loaded
    for engine in loaded.values():
        engine.close()


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_tensorrt_matches_onnxruntime(demo_dir: Path, engines, precision: str) -> None:
    manifest = load_manifest(demo_dir)
    engine = engines[precision]
    reference = OnnxRuntimeEngine.from_model_dir(demo_dir, manifest, precision=precision)
    spec = manifest.profiles[precision][0]
    inputs = _inputs(spec.batch[2], seed=99)
    length = inputs[manifest.history.input].shape[1] if manifest.history else 0
    if manifest.history and spec.history_length and length > spec.history_length[2]:
        pytest.skip("held-out batch longer than the profile; see the pool test")
    got = engine.infer(inputs)[manifest.output]
    want = reference.infer(inputs)[manifest.output]
    assert np.abs(got - want).max() < LIMITS[precision]


def test_too_long_history_is_a_shape_mismatch_and_pool_falls_back(demo_dir: Path, engines) -> None:
    manifest = load_manifest(demo_dir)
    assert manifest.history is not None
    engine = engines["fp16"]
    spec = manifest.profiles["fp16"][0]
    assert spec.history_length is not None
    inputs = _inputs(4, seed=5)
    too_long = spec.history_length[2] + 8
    for name in (manifest.history.input, manifest.history.mask_input):
        arr = inputs[name]
        pad = [(0, 0), (0, too_long - arr.shape[1])] + [(0, 0)] * (arr.ndim - 2)
        inputs[name] = np.pad(arr, pad)
    inputs[manifest.history.mask_input][0, :] = 1.0
    with pytest.raises(ShapeMismatch):
        engine.infer(inputs)
    fallback = OnnxRuntimeEngine.from_model_dir(demo_dir, manifest)
    pool = EnginePool.for_manifest(manifest, [engine], fallback)
    result = pool.run(inputs)
    assert result.row_engines[0] == fallback.name
    assert result.fallback_reason.startswith("shape_mismatch")
