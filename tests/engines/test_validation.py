from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from sklearn.metrics import roc_auc_score

from engines.onnxrt import OnnxRuntimeEngine
from engines.precision import make_variants, set_manifest_variants
from engines.validation import (
    ValidationReport,
    accepted_variants,
    auc,
    load_report,
    validate_model,
    write_report,
)


def _held_out(model_dir: Path, inputs_factory, n: int = 2000):
    inputs = inputs_factory(n, seed=23)
    scores = OnnxRuntimeEngine.from_path(model_dir / "model.onnx").infer(inputs)["score"].ravel()
    # Labels drawn from the model's own probabilities: its AUC is then well above 0.5.
    labels = np.random.default_rng(5).random(n) < scores
    return inputs, labels


def test_auc_matches_sklearn_with_ties() -> None:
    rng = np.random.default_rng(0)
    labels = rng.random(500) < 0.3
    scores = np.round(rng.random(500) + labels * 0.3, 1)  # many ties
    assert auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)


def test_auc_needs_both_classes() -> None:
    with pytest.raises(ValueError):
        auc(np.ones(5), np.arange(5.0))


def test_fp16_and_int8_measured_against_fp32(model_dir: Path, inputs_factory) -> None:
    make_variants(model_dir)
    inputs, labels = _held_out(model_dir, inputs_factory)
    report = validate_model(model_dir, inputs, labels)
    assert [v.precision for v in report.variants] == ["fp32", "fp16", "int8"]
    fp32, fp16, int8 = report.variants
    assert fp32.max_abs_error == 0.0 and fp32.flip_rate == 0.0
    assert fp32.auc == pytest.approx(roc_auc_score(labels, _fp32(model_dir, inputs)))
    assert 0 < fp16.max_abs_error < 0.01
    assert fp16.mean_abs_error <= fp16.max_abs_error
    assert int8.max_abs_error > fp16.max_abs_error
    assert report.passes("fp16")
    assert 0.0 <= int8.flip_rate <= 1.0


def _fp32(model_dir: Path, inputs) -> np.ndarray:
    return OnnxRuntimeEngine.from_path(model_dir / "model.onnx").infer(inputs)["score"].ravel()


def test_tolerance_gate_refuses_a_perturbed_variant(
    model_dir: Path, inputs_factory, model_factory
) -> None:
    onnx.save(model_factory(weight_noise=0.5), model_dir / "model.bad.onnx")
    make_variants(model_dir)
    set_manifest_variants(model_dir, {"fp16": "model.fp16.onnx", "int8": "model.bad.onnx"})
    inputs, labels = _held_out(model_dir, inputs_factory)
    report = validate_model(model_dir, inputs, labels)
    bad = report.variant("int8")
    assert not report.passes("int8")
    assert any(f.startswith("max_abs_error") for f in bad.failures(report.tolerance))
    write_report(model_dir, report)
    accepted = accepted_variants(model_dir)
    assert set(accepted) == {"fp32", "fp16"}
    assert "REFUSED" in report.to_table()


def test_report_round_trips_through_json(model_dir: Path, inputs_factory) -> None:
    make_variants(model_dir)
    inputs, labels = _held_out(model_dir, inputs_factory, n=400)
    report = validate_model(model_dir, inputs, labels)
    data = json.loads(report.to_json())
    assert data["variants"][1]["passes"] == report.passes("fp16")
    assert ValidationReport.from_json(report.to_json()) == report
    write_report(model_dir, report)
    assert load_report(model_dir) == report


def test_unvalidated_variants_are_refused(model_dir: Path) -> None:
    make_variants(model_dir)
    assert set(accepted_variants(model_dir)) == {"fp32"}


def test_report_for_another_version_is_ignored(model_dir: Path, inputs_factory) -> None:
    make_variants(model_dir)
    inputs, labels = _held_out(model_dir, inputs_factory, n=400)
    report = validate_model(model_dir, inputs, labels)
    other = ValidationReport(report.model, "999", report.rows, report.tolerance, report.variants)
    assert set(accepted_variants(model_dir, other)) == {"fp32"}
    assert "fp16" in accepted_variants(model_dir, report)
