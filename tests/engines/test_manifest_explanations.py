"""Explanations in the manifest: refused when inconsistent; baselines from reference data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from engines import baselines
from engines.manifest import Manifest, load_manifest

DEMO = Path(__file__).resolve().parents[2] / "models" / "fraud-demo" / "1"


def _manifest(explanations: dict, history: bool = True) -> dict:
    data = {
        "name": "m",
        "version": "1",
        "features": ["a", "b", "c"],
        "thresholds": {"review": 0.5, "decline": 0.9},
        "explanations": explanations,
    }
    if history:
        data["history"] = {"fields": ["h"], "max_length": 4}
    return data


@pytest.mark.parametrize(
    ("explanations", "history", "message"),
    [
        ({"features": {"z": {"baseline": 1.0}}}, True, "features['z']: not a feature"),
        ({"features": {"a": {"baseline": 1.0, "code": "R1"}}}, True, "code 'R1' has no text"),
        (
            {
                "features": {
                    "a": {"baseline": 1.0, "code": "R1", "text": "one"},
                    "b": {"baseline": 1.0, "code": "R1", "text": "other"},
                }
            },
            True,
            "conflicting texts",
        ),
        ({"features": {"a": {"code": "R1", "text": "t"}}}, True, "needs a baseline"),
        ({"features": {"a": {"baseline": 0.0, "text": "t"}}}, True, "text: given without a code"),
        ({"history": {"code": "H", "text": "t"}}, False, "takes no history"),
        ({"features": {"a": {"baseline": 0, "code": "bad code", "text": "t"}}}, True, "pattern"),
        ({"history": {"code": "H", "text": "t", "baseline": "median"}}, True, "'empty'"),
    ],
)
def test_bad_explanations_are_refused_at_load(explanations, history, message):
    with pytest.raises(ValidationError, match="explanations") as caught:
        Manifest.model_validate(_manifest(explanations, history))
    assert message in str(caught.value)


@pytest.mark.parametrize("baseline", [float("nan"), float("inf"), float("-inf"), 1e39, -1e39])
@pytest.mark.parametrize("coded", [True, False])
def test_a_baseline_that_is_not_a_finite_number_is_refused_naming_it(tmp_path, baseline, coded):
    """Occluding with it would score NaN: every explained request would get no reasons, the
    declines included. The manifest file is refused at load instead, naming the entry."""
    entry = (
        {"baseline": baseline, "code": "AMT", "text": "amount"} if coded else {"baseline": baseline}
    )
    data = _manifest({"features": {"a": {"baseline": 1.0}, "b": entry}})
    (tmp_path / "manifest.json").write_text(json.dumps(data))  # NaN and Infinity, as JSON allows
    with pytest.raises(ValidationError) as caught:
        load_manifest(tmp_path)
    assert f"explanations.features['b'].baseline: {baseline} is not a finite number" in str(
        caught.value
    )


def test_codes_group_features_and_history_sorted_by_code():
    manifest = Manifest.model_validate(
        _manifest(
            {
                "features": {
                    "c": {"baseline": 3.0, "code": "R2"},
                    "a": {"baseline": 1.0, "code": "R2", "text": "a and c"},
                    "b": {"baseline": 2.0},
                },
                "history": {"code": "R1", "text": "history"},
            }
        )
    )
    codes = manifest.reason_codes
    assert [c.code for c in codes] == ["R1", "R2"]
    assert codes[0].features == () and codes[0].history
    assert codes[1].features == ("a", "c") and codes[1].baselines == (1.0, 3.0)
    assert codes[1].text == "a and c" and not codes[1].history


def test_the_demo_manifest_declares_every_feature_and_the_history():
    manifest = load_manifest(DEMO)
    codes = manifest.reason_codes
    covered = {f for c in codes for f in c.features}
    assert covered == set(manifest.features)
    assert sum(c.history for c in codes) == 1
    assert all(c.text for c in codes)


def _reference(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"a": rng.normal(10.0, 1.0, n), "b": rng.integers(0, 2, n), "c": rng.exponential(3.0, n)}


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".npz"])
def test_baselines_command_writes_medians_and_keeps_codes(tmp_path, suffix):
    model_dir = tmp_path / "m" / "1"
    model_dir.mkdir(parents=True)
    # Codes declared before any baseline exists: the command must still read the manifest.
    declared = _manifest({"features": {"a": {"code": "R1", "text": "a is high"}}})
    (model_dir / "manifest.json").write_text(json.dumps(declared))
    columns = _reference(501)
    data = tmp_path / f"ref{suffix}"
    table = pa.table({**columns, "unrelated": np.zeros(501)})
    if suffix == ".parquet":
        pq.write_table(table, data)
    elif suffix == ".csv":
        pcsv.write_csv(table, data)
    else:
        np.savez(data, features=np.column_stack([columns[n] for n in "abc"]))
    assert baselines.main([str(model_dir), "--data", str(data)]) == 0
    manifest = load_manifest(model_dir)
    assert manifest.explanations is not None
    for name in "abc":
        assert manifest.explanations.features[name].baseline == pytest.approx(
            float(np.median(columns[name])), abs=1e-5
        )
    assert manifest.reason_codes[0].code == "R1"
    assert manifest.reason_codes[0].text == "a is high"


def test_baselines_command_refuses_data_without_the_features(tmp_path):
    model_dir = tmp_path / "1"
    model_dir.mkdir()
    (model_dir / "manifest.json").write_text(json.dumps(_manifest({})))
    data = tmp_path / "ref.csv"
    pcsv.write_csv(pa.table({"a": [1.0, 2.0]}), data)
    with pytest.raises(ValueError, match="lacks feature columns: b, c"):
        baselines.main([str(model_dir), "--data", str(data)])


def test_demo_baselines_are_the_generator_medians(tmp_path):
    """The demo's baselines are what the command computes from the documented reference draw."""
    from demo.generator import generate

    model_dir = tmp_path / "1"
    shutil.copytree(DEMO, model_dir, ignore=shutil.ignore_patterns("*.onnx", "*.npz"))
    data = tmp_path / "ref.npz"
    np.savez(data, features=generate(20000, seed=5_000_021).features)
    assert baselines.main([str(model_dir), "--data", str(data), "--dry-run"]) == 0
    computed = baselines.compute_baselines(
        load_manifest(model_dir), baselines.read_reference(data, load_manifest(model_dir))
    )
    declared = load_manifest(DEMO).explanations
    assert declared is not None
    for name, value in computed.items():
        assert declared.features[name].baseline == pytest.approx(value, abs=1e-5)
