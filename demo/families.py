"""Classifiers of the families risk teams ship, trained on generated data and exported to ONNX
the way each library's own documentation shows, with a riskserve manifest beside them."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

N_FEATURES = 10
FEATURES = [f"f{i}" for i in range(N_FEATURES)]
TRAIN_ROWS = 3000
HELD_OUT_ROWS = 2000


def dataset(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train features, train labels, held-out features): float32 rows of a noisy logistic
    process with interactions, the positive class (1) the rarer one, as fraud is."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(TRAIN_ROWS + HELD_OUT_ROWS, N_FEATURES)).astype(np.float32)
    logit = 1.5 * x[:, 0] - x[:, 1] + 0.8 * x[:, 2] * x[:, 3] + np.abs(x[:, 4]) - 2.0
    y = (rng.uniform(size=len(x)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    return x[:TRAIN_ROWS], y[:TRAIN_ROWS], x[TRAIN_ROWS:]


@dataclass(frozen=True)
class Exported:
    """One trained classifier, its ONNX export, and how to reach its parts."""

    family: str
    zipmap: bool
    estimator: Any
    model: onnx.ModelProto
    input_name: str
    probability_output: str

    def risk_scores(self, x: np.ndarray) -> np.ndarray:
        """The library's own `predict_proba` for the risk class (1)."""
        column = list(self.estimator.classes_).index(1)
        return np.asarray(self.estimator.predict_proba(x), dtype=np.float64)[:, column]


def _skl2onnx(estimator: Any, zipmap: bool) -> tuple[onnx.ModelProto, str]:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    model = convert_sklearn(
        estimator,
        initial_types=[("input", FloatTensorType([None, N_FEATURES]))],
        options={id(estimator): {"zipmap": zipmap}},
    )
    return model, "input"


def _onnxmltools(convert: Callable[..., onnx.ModelProto], estimator: Any, **options: Any) -> Any:
    from onnxmltools.convert.common.data_types import FloatTensorType

    initial = [("input", FloatTensorType([None, N_FEATURES]))]
    return convert(estimator, initial_types=initial, **options), "input"


def _train(family: str, x: np.ndarray, y: np.ndarray) -> Any:
    if family == "logistic":
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(max_iter=500).fit(x, y)
    if family == "random-forest":
        from sklearn.ensemble import RandomForestClassifier

        return RandomForestClassifier(n_estimators=20, max_depth=6, random_state=0).fit(x, y)
    if family == "gradient-boosting":
        from sklearn.ensemble import GradientBoostingClassifier

        return GradientBoostingClassifier(n_estimators=30, max_depth=3, random_state=0).fit(x, y)
    if family == "lightgbm":
        import lightgbm

        return lightgbm.LGBMClassifier(n_estimators=40, num_leaves=15, verbose=-1).fit(x, y)
    if family == "xgboost":
        import xgboost

        return xgboost.XGBClassifier(n_estimators=40, max_depth=4).fit(x, y)
    if family == "catboost":
        import catboost

        return catboost.CatBoostClassifier(
            iterations=40, depth=4, verbose=0, allow_writing_files=False
        ).fit(x, y)
    raise ValueError(family)


def export(family: str, zipmap: bool, folder: Path) -> Exported:
    """Train `family` on `dataset()` and export it; CatBoost's exporter always writes a ZipMap,
    onnxmltools' XGBoost converter never does."""
    x, y, _ = dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # converters' and trainers' own deprecation notes
        estimator = _train(family, x, y)
        if family in ("logistic", "random-forest", "gradient-boosting"):
            model, input_name = _skl2onnx(estimator, zipmap)
        elif family == "lightgbm":
            from onnxmltools import convert_lightgbm

            model, input_name = _onnxmltools(convert_lightgbm, estimator, zipmap=zipmap)
        elif family == "xgboost":
            from onnxmltools import convert_xgboost

            model, input_name = _onnxmltools(convert_xgboost, estimator)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            estimator.save_model(str(folder / "catboost.onnx"), format="onnx")
            model = onnx.load(str(folder / "catboost.onnx"))
            (folder / "catboost.onnx").unlink()
            input_name = model.graph.input[0].name
    outputs = [o.name for o in model.graph.output]
    probability = next(n for n in outputs if "prob" in n)
    return Exported(family, zipmap, estimator, model, input_name, probability)


def write_version(
    exported: Exported,
    root: Path,
    name: str,
    version: str = "1",
    *,
    risk_class: int | str | None = 1,
    **manifest: Any,
) -> Path:
    """`exported` as a model version folder of riskserve."""
    folder = root / name / version
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(exported.model, folder / "model.onnx")
    body: dict[str, Any] = {
        "name": name,
        "version": version,
        "description": f"{exported.family} classifier (test)",
        "features_input": exported.input_name,
        "features": FEATURES,
        "output": exported.probability_output,
        "nan_policy": "reject",
        "thresholds": {"review": 0.3, "decline": 0.7},
        "max_batch_size": 64,
        **manifest,
    }
    if risk_class is not None:
        body["risk_class"] = risk_class
    (folder / "manifest.json").write_text(json.dumps(body, indent=2))
    return folder


# (family, zipmap) pairs: both settings where the converter has the option.
EXPORTS = [
    ("logistic", True),
    ("logistic", False),
    ("random-forest", True),
    ("random-forest", False),
    ("gradient-boosting", True),
    ("gradient-boosting", False),
    ("lightgbm", True),
    ("lightgbm", False),
    ("xgboost", False),
    ("catboost", True),
]
