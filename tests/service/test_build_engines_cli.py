"""`riskserve build-engines` as the README writes it, on the demo and on a tree ensemble."""

from __future__ import annotations

from pathlib import Path

import pytest

from demo.families import export, write_version
from engines.base import EngineUnavailable
from engines.trt.lib import import_tensorrt
from service.cli import main

DEMO = Path(__file__).resolve().parents[2] / "models" / "fraud-demo" / "1"


def test_without_precision_it_builds_the_default_ones_or_says_why_not(capsys):
    """No --precision means FP16 and INT8; here TensorRT is missing, and it says only that."""
    try:
        import_tensorrt()
    except EngineUnavailable:
        pass
    else:
        pytest.skip("TensorRT is installed: tests/gpu builds plans")
    assert main(["build-engines", str(DEMO)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("riskserve build-engines: TensorRT is not installed"), error
    assert "\n" not in error


def test_a_tree_ensemble_is_left_to_onnx_runtime_in_one_line(tmp_path: Path, capsys):
    folder = write_version(export("xgboost", False, tmp_path / "x"), tmp_path, "trees")
    assert main(["build-engines", str(folder)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        "riskserve build-engines: trees/1: TensorRT has no layers for TreeEnsembleClassifier "
        "(ai.onnx.ml); ONNX Runtime serves this model"
    )
