from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from sklearn.metrics import roc_auc_score

from engines.onnxrt import OnnxRuntimeEngine
from engines.precision import make_variants, set_manifest_variants
from engines.trt.plans import sha256_file
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


def _validated(model_dir: Path, inputs_factory) -> ValidationReport:
    """Variants made and checked under a tolerance any variant meets, the report saved: every
    variant is accepted."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    manifest["tolerance"] = {"max_abs_error": 1.0, "auc_drop": 1.0, "flip_rate": 1.0}
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    make_variants(model_dir)
    inputs, labels = _held_out(model_dir, inputs_factory, n=400)
    report = validate_model(model_dir, inputs, labels)
    write_report(model_dir, report)
    assert set(accepted_variants(model_dir)) == {"fp32", "fp16", "int8"}
    return report


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "engines.validation" and r.levelname == "WARNING"
    ]


def test_report_records_the_sha256_of_every_file_it_scored(model_dir: Path, inputs_factory) -> None:
    report = _validated(model_dir, inputs_factory)
    assert report.onnx_sha256 == sha256_file(model_dir / "model.onnx")
    for v in report.variants:
        assert v.sha256 == sha256_file(model_dir / v.file)
    saved = json.loads((model_dir / "validation.json").read_text())
    assert [v["sha256"] for v in saved["variants"]] == [v.sha256 for v in report.variants]


def test_model_replaced_in_place_refuses_every_variant_with_one_warning(
    model_dir: Path, inputs_factory, model_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """The FP16/INT8 files were made from the old weights: the report vouches for them only
    beside the `model.onnx` it compared them with."""
    _validated(model_dir, inputs_factory)
    caplog.clear()
    onnx.save(model_factory(seed=9), model_dir / "model.onnx")
    assert accepted_variants(model_dir) == {"fp32": model_dir / "model.onnx"}
    (message,) = _refusals(caplog)
    assert str(model_dir / "validation.json") in message
    assert "model.fp16.onnx" in message and "model.int8.onnx" in message
    assert "model.onnx has changed since the report was made" in message
    assert f"riskserve validate {model_dir}" in message
    # The check run again vouches for the variants beside the new weights (here: made again).
    caplog.clear()
    _validated(model_dir, inputs_factory)
    assert _refusals(caplog) == []


def test_variant_rewritten_after_the_check_is_refused_alone(
    model_dir: Path, inputs_factory, model_factory, caplog: pytest.LogCaptureFixture
) -> None:
    _validated(model_dir, inputs_factory)
    caplog.clear()
    onnx.save(model_factory(weight_noise=0.5), model_dir / "model.int8.onnx")
    assert set(accepted_variants(model_dir)) == {"fp32", "fp16"}
    (message,) = _refusals(caplog)
    assert "int8 (model.int8.onnx): changed since the report was made" in message
    assert "fp16" not in message


def test_report_without_hashes_validates_no_variant(
    model_dir: Path, inputs_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A report written before hashes were recorded says nothing about the files now."""
    _validated(model_dir, inputs_factory)
    path = model_dir / "validation.json"
    data = json.loads(path.read_text())
    for variant in data["variants"]:
        del variant["sha256"]
    path.write_text(json.dumps(data))
    caplog.clear()
    report = load_report(model_dir)
    assert report is not None and report.onnx_sha256 is None
    assert report.passes("fp16")  # still readable, as a record of the old check
    assert set(accepted_variants(model_dir)) == {"fp32"}
    (message,) = _refusals(caplog)
    assert "no file hashes (an older format)" in message
    assert "riskserve validate" in message


def test_report_copied_from_another_version_is_named_in_the_warning(
    model_dir: Path, inputs_factory, caplog: pytest.LogCaptureFixture
) -> None:
    report = _validated(model_dir, inputs_factory)
    data = json.loads(report.to_json())
    data["version"] = "0"
    (model_dir / "validation.json").write_text(json.dumps(data))
    caplog.clear()
    assert set(accepted_variants(model_dir)) == {"fp32"}
    (message,) = _refusals(caplog)
    assert str(model_dir / "validation.json") in message
    assert "the report is for tiny version 0, not tiny version 1" in message


def test_declared_variants_without_a_report_are_refused_loudly(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_variants(model_dir)
    assert set(accepted_variants(model_dir)) == {"fp32"}
    (message,) = _refusals(caplog)
    assert "no report has been written" in message


def test_no_variants_declared_means_no_check_and_no_warning(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert set(accepted_variants(model_dir)) == {"fp32"}
    assert _refusals(caplog) == []


def test_the_committed_demo_variants_are_vouched_for_as_they_are(
    caplog: pytest.LogCaptureFixture,
) -> None:
    demo = Path(__file__).resolve().parents[2] / "models" / "fraud-demo" / "1"
    assert set(accepted_variants(demo)) == {"fp32", "fp16", "int8"}
    assert _refusals(caplog) == []


def test_a_zipmap_classifier_is_validated_on_its_risk_class(tmp_path: Path):
    """The check reads the score as the server does: the risk class's column of the maps."""
    from demo.families import dataset, export, write_version

    exported = export("logistic", True, tmp_path / "export")
    folder = write_version(exported, tmp_path, "lr")
    _, _, held_out = dataset()
    want = exported.risk_scores(held_out)
    labels = (want > 0.5).astype(np.int64)  # any labels with both classes will do
    report = validate_model(folder, {exported.input_name: held_out}, labels)
    (fp32,) = report.variants
    assert fp32.precision == "fp32"
    assert fp32.auc == pytest.approx(auc(labels, want), abs=1e-6)


def _nan_where_first_feature_below(model_dir: Path, low: float) -> onnx.ModelProto:
    """The FP32 model's score plus 0 * log(f0 - low): equal to FP32 where f0 > low, NaN below."""
    model = onnx.load(str(model_dir / "model.onnx"))
    graph = model.graph
    for node in graph.node:
        if node.op_type == "Sigmoid":
            node.output[0] = "score0"
    graph.initializer.extend(
        [
            onnx.numpy_helper.from_array(np.array([0], dtype=np.int64), "col0"),
            onnx.numpy_helper.from_array(np.array(-low, dtype=np.float32), "shift"),
            onnx.numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
        ]
    )
    graph.node.extend(
        [
            onnx.helper.make_node("Gather", ["features", "col0"], ["f0"], axis=1),
            onnx.helper.make_node("Add", ["f0", "shift"], ["shifted"]),
            onnx.helper.make_node("Log", ["shifted"], ["log"]),
            onnx.helper.make_node("Mul", ["log", "zero"], ["nan_part"]),
            onnx.helper.make_node("Add", ["score0", "nan_part"], ["score"]),
        ]
    )
    onnx.checker.check_model(model)
    return model


def test_a_variant_scoring_nan_on_a_few_rows_is_refused(model_dir: Path, inputs_factory) -> None:
    """NaN compares false with every limit; the variant is refused for its NaN scores."""
    onnx.save(_nan_where_first_feature_below(model_dir, -5.0), model_dir / "model.nan.onnx")
    set_manifest_variants(model_dir, {"fp16": "model.nan.onnx"})
    inputs, labels = _held_out(model_dir, inputs_factory)
    inputs["features"][[3, 70], 0] = -10.0
    report = validate_model(model_dir, inputs, labels)
    nan = report.variant("fp16")
    assert nan.non_finite_scores == 2
    assert np.isnan(nan.auc) and np.isnan(nan.auc_drop)
    failures = nan.failures(report.tolerance)
    assert "2 scores are NaN or infinite" in failures
    assert "max_abs_error is nan, not a finite number" in failures
    assert not report.passes("fp16")
    write_report(model_dir, report)
    assert set(accepted_variants(model_dir)) == {"fp32"}
    assert "REFUSED: 2 scores are NaN or infinite" in report.to_table()


def test_a_saved_report_with_a_nan_measure_vouches_for_nothing(
    model_dir: Path, inputs_factory
) -> None:
    """A report written before non-finite scores were counted may hold a NaN error."""
    report = _validated(model_dir, inputs_factory)
    data = json.loads(report.to_json())
    for variant in data["variants"]:
        variant.pop("non_finite_scores")
        if variant["precision"] == "int8":
            variant["max_abs_error"] = float("nan")
    (model_dir / "validation.json").write_text(json.dumps(data))
    assert set(accepted_variants(model_dir)) == {"fp32", "fp16"}


def test_auc_of_scores_holding_nan_is_nan() -> None:
    labels = np.array([0, 1, 0, 1])
    assert np.isnan(auc(labels, np.array([0.1, 0.9, np.nan, 0.8])))
    assert auc(labels, np.array([0.1, 0.9, -np.inf, np.inf])) == 1.0
