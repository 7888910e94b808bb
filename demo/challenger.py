"""Train the demo's gradient-boosted challenger: LightGBM on demo.generator data, exported to ONNX
with the same inputs as `fraud-demo` version 1, so it scores the same requests in shadow or A/B.

Run from the repository root with the `train-gbm` extra (LightGBM, onnxmltools; no GPU, no
PyTorch)::

    python -m demo.challenger --out demo/experiment/fraud-demo/2 --seed 0

LightGBM sees the 31 tabular features plus nine summaries of the account's history: the mean of
each history field over the real rows, and their number. The summaries are computed inside the
exported graph from the ``history`` and ``history_mask`` inputs (masked sums as MatMuls), so a
caller sends exactly what version 1 takes, and training computes them the same way in numpy.
The classifier is exported by onnxmltools with its default ZipMap output; the manifest declares
``risk_class`` 1 (fraud). Writes ``model.onnx`` and ``manifest.json`` into ``--out`` and prints
the held-out AUC beside version 1's.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from demo.cutoffs import add_training_arguments, thresholds
from demo.generator import FEATURE_NAMES, FEATURE_RANGES, HISTORY_FIELDS, DemoData, generate
from demo.generator import model_inputs as padded_inputs

VALIDATION_SEED_OFFSET = 1_000_003
HELD_OUT_SEED = 5_000_011  # what bench.demo_model_cost scores version 1 on
CHAMPION = Path(__file__).resolve().parents[1] / "models" / "fraud-demo" / "1"
SUMMARIES = (*(f"history_mean_{name}" for name in HISTORY_FIELDS), "history_rows")


def summaries(history: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(n, 9): each history field's mean over real rows (0 with none), then their number;
    float32 arithmetic in the graph's order, so training sees what serving computes."""
    mask = mask.astype(np.float32)
    sums = np.einsum("nt,ntf->nf", mask, history.astype(np.float32))
    count = mask.sum(axis=1, keepdims=True, dtype=np.float32)
    return np.concatenate([sums / np.maximum(count, 1.0), count], axis=1).astype(np.float32)


def tabular(data: DemoData) -> np.ndarray:
    inputs = padded_inputs(data)
    return np.concatenate(
        [inputs["features"], summaries(inputs["history"], inputs["history_mask"])], axis=1
    )


def _with_history_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """The converted classifier, fed by nodes that build its input row from version 1's three
    inputs: features, and the history summaries."""
    graph = model.graph
    (row_input,) = [i.name for i in graph.input]
    width = len(HISTORY_FIELDS)
    nodes = [
        helper.make_node("Reshape", ["history_mask", "shape_n_1_t"], ["mask_row"]),
        helper.make_node("MatMul", ["mask_row", "history"], ["sums_3d"]),
        helper.make_node("Reshape", ["sums_3d", "shape_n_f"], ["sums"]),
        helper.make_node("Reshape", ["history_mask", "shape_n_t_1"], ["mask_column"]),
        helper.make_node("MatMul", ["mask_row", "mask_column"], ["count_3d"]),
        helper.make_node("Reshape", ["count_3d", "shape_n_1"], ["count"]),
        helper.make_node("Max", ["count", "one"], ["denominator"]),
        helper.make_node("Div", ["sums", "denominator"], ["means"]),
        helper.make_node("Concat", ["features", "means", "count"], [row_input], axis=1),
    ]
    constants = {
        "shape_n_1_t": np.array([0, 1, -1], np.int64),
        "shape_n_t_1": np.array([0, -1, 1], np.int64),
        "shape_n_f": np.array([-1, width], np.int64),
        "shape_n_1": np.array([-1, 1], np.int64),
        "one": np.array([1.0], np.float32),
    }
    inputs = [
        helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", len(FEATURE_NAMES)]),
        helper.make_tensor_value_info("history", TensorProto.FLOAT, ["batch", "length", width]),
        helper.make_tensor_value_info("history_mask", TensorProto.FLOAT, ["batch", "length"]),
    ]
    del graph.input[:]
    graph.input.extend(inputs)
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in constants.items())
    for node in reversed(nodes):
        graph.node.insert(0, node)
    onnx.checker.check_model(model)
    return model


def _explanations() -> dict:
    """Version 1's reason codes and baselines: the same codes explain both arms."""
    return json.loads((CHAMPION / "manifest.json").read_text())["explanations"]


def _manifest(review: float, decline: float, auc: float, probability_output: str) -> dict:
    return {
        "name": "fraud-demo",
        "version": "2",
        "description": (
            "Card-fraud demo challenger: LightGBM over the tabular features and summaries of "
            f"the history, trained on demo.generator data (held-out AUC {auc:.3f}); see "
            "docs/shadow.md."
        ),
        "features_input": "features",
        "features": list(FEATURE_NAMES),
        "history": {
            "input": "history",
            "mask_input": "history_mask",
            "fields": list(HISTORY_FIELDS),
            "max_length": 256,
            "min_padded_length": 1,
        },
        "output": probability_output,
        "risk_class": 1,
        "nan_policy": "reject",
        "thresholds": {"review": review, "decline": decline},
        "fallback_decision": "REVIEW",
        "max_batch_size": 256,
        "feature_ranges": {name: list(FEATURE_RANGES[name]) for name in FEATURE_NAMES},
        "explanations": _explanations(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser)
    parser.add_argument("--trees", type=int, default=200)
    args = parser.parse_args(argv)

    import lightgbm
    import onnxruntime as ort
    from onnxmltools import convert_lightgbm
    from onnxmltools.convert.common.data_types import FloatTensorType
    from sklearn.metrics import roc_auc_score

    train = generate(args.train_size, args.seed)
    validation = generate(args.validation_size, args.seed + VALIDATION_SEED_OFFSET)
    print(f"train {len(train.labels)} rows, fraud rate {train.labels.mean():.4f}")
    classifier = lightgbm.LGBMClassifier(
        n_estimators=args.trees,
        num_leaves=31,
        learning_rate=0.05,
        random_state=args.seed,
        deterministic=True,
        n_jobs=2,
        verbose=-1,
    )
    classifier.fit(tabular(train), train.labels)
    width = len(FEATURE_NAMES) + len(SUMMARIES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = convert_lightgbm(
            classifier, initial_types=[("row", FloatTensorType([None, width]))]
        )
    probability_output = next(o.name for o in converted.graph.output if "prob" in o.name)
    model = _with_history_inputs(converted)

    args.out.mkdir(parents=True, exist_ok=True)
    model_path = args.out / "model.onnx"
    onnx.save(model, str(model_path))

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    held_out = generate(20_000, HELD_OUT_SEED)
    results = {}
    for name, data in (("validation", validation), ("held-out", held_out)):
        library = classifier.predict_proba(tabular(data))[:, 1]
        maps = session.run([probability_output], padded_inputs(data))[0]
        served = np.array([m[1] for m in maps])
        results[name] = (served, library)
        print(f"{name}: max |onnxruntime - lightgbm| {np.abs(served - library).max():.2e}")
    scores = results["validation"][0]
    review, decline = thresholds(
        scores, validation.labels, args.review_rate, args.decline_precision
    )
    auc = float(roc_auc_score(held_out.labels, results["held-out"][0]))
    manifest = _manifest(review, decline, auc, probability_output)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"held-out AUC {auc:.4f} ({len(held_out.labels)} rows, seed {HELD_OUT_SEED})")
    print(f"thresholds: review >= {review}, decline >= {decline}")


if __name__ == "__main__":
    main()
