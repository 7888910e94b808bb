from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from engines.manifest import load_manifest
from engines.onnxrt import OnnxRuntimeEngine
from engines.precision import NpzCalibrationReader, main, make_variants, zero_points


@pytest.fixture
def variants(model_dir: Path) -> Path:
    make_variants(model_dir)
    return model_dir


def test_int8_zero_points_are_all_zero(variants: Path) -> None:
    model = onnx.load(str(variants / "model.int8.onnx"))
    points = zero_points(model)
    assert points, "the INT8 model has no Q/DQ zero points"
    for name, value in points.items():
        assert value.dtype == np.int8, name
        assert not value.any(), f"{name} is not symmetric"


def test_int8_quantizes_matmul_only(variants: Path) -> None:
    model = onnx.load(str(variants / "model.int8.onnx"))
    produced_by_dq = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    consumers = {n.op_type for n in model.graph.node if set(n.input) & produced_by_dq}
    assert consumers == {"MatMul"}
    types = {n.op_type for n in model.graph.node}
    assert not types & {"DynamicQuantizeLinear", "MatMulInteger", "QLinearMatMul"}


def test_weights_are_per_channel(variants: Path) -> None:
    model = onnx.load(str(variants / "model.int8.onnx"))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    assert inits["w_f_scale"].shape == (16,)


def test_fp16_keeps_fp32_io(variants: Path) -> None:
    model = onnx.load(str(variants / "model.fp16.onnx"))
    for value in (*model.graph.input, *model.graph.output):
        assert value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)


def test_both_variants_run_on_onnxruntime_cpu(variants: Path, inputs_factory) -> None:
    inputs = inputs_factory(200, seed=11)
    reference = OnnxRuntimeEngine.from_path(variants / "model.onnx").infer(inputs)["score"]
    for file, limit in (("model.fp16.onnx", 0.005), ("model.int8.onnx", 0.1)):
        engine = OnnxRuntimeEngine.from_path(variants / file)
        assert engine.name == "onnxruntime-cpu"
        scores = engine.infer(inputs)["score"]
        assert scores.dtype == np.float32
        assert np.abs(scores - reference).max() < limit, file


def test_manifest_gets_only_the_variants_key(model_dir: Path) -> None:
    before = json.loads((model_dir / "manifest.json").read_text())
    assert main([str(model_dir)]) == 0
    after = json.loads((model_dir / "manifest.json").read_text())
    assert after.pop("variants") == {"fp16": "model.fp16.onnx", "int8": "model.int8.onnx"}
    before.pop("variants", None)
    assert after == before
    assert load_manifest(model_dir).variants["int8"] == "model.int8.onnx"


def test_calibration_reader_batches_all_rows(model_dir: Path) -> None:
    reader = NpzCalibrationReader(
        model_dir / "calibration.npz", ["features", "history", "history_mask"], batch_size=100
    )
    ort_reader = reader.reader()
    sizes = []
    while (batch := ort_reader.get_next()) is not None:
        sizes.append(len(batch["features"]))
    assert sizes == [100, 100, 56]


def test_calibration_arrays_must_agree(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="differ"):
        NpzCalibrationReader({"a": np.zeros((3, 1)), "b": np.zeros((4, 1))}, ["a", "b"])
