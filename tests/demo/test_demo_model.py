"""The committed `fraud-demo` model: quality on unseen data, padding, manifest and ONNX agree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from sklearn.metrics import roc_auc_score

from demo.generator import FEATURE_NAMES, HISTORY_FIELDS, DemoData, generate, pad_histories
from engines.manifest import load_manifest

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "fraud-demo" / "1"
# demo.train with --seed 0 draws data from seeds 0, 1_000_003 and 2_000_003; this one is unused.
HELD_OUT_SEED = 4_242_424


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(
        str(MODEL_DIR / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )


def _score(session: ort.InferenceSession, features: np.ndarray, histories, min_length: int = 1):
    history, mask = pad_histories(histories, min_length)
    feed = {"features": features, "history": history, "history_mask": mask}
    return session.run(["score"], feed)[0]


def _score_all(session: ort.InferenceSession, data: DemoData) -> np.ndarray:
    """Scores in batches of similar history length, to keep padding (and time) small."""
    order = np.argsort([len(h) for h in data.histories], kind="stable")
    scores = np.empty(len(order), np.float32)
    for start in range(0, len(order), 512):
        idx = order[start : start + 512]
        out = _score(session, data.features[idx], [data.histories[i] for i in idx])
        scores[idx] = out[:, 0]
    return scores


def test_auc_on_unseen_data(session: ort.InferenceSession) -> None:
    data = generate(6000, seed=HELD_OUT_SEED)
    scores = _score_all(session, data)
    assert np.isfinite(scores).all() and scores.min() >= 0.0 and scores.max() <= 1.0
    assert roc_auc_score(data.labels, scores) > 0.85


def test_padding_does_not_change_a_rows_score(session: ort.InferenceSession) -> None:
    data = generate(48, seed=HELD_OUT_SEED + 1)
    histories = [*data.histories[:-1], np.zeros((0, len(HISTORY_FIELDS)), np.float32)]
    alone = np.array(
        [_score(session, data.features[i : i + 1], [h])[0, 0] for i, h in enumerate(histories)]
    )
    batched = _score(session, data.features, histories, min_length=230)[:, 0]
    np.testing.assert_allclose(batched, alone, rtol=0, atol=1e-6)
    half = _score(session, data.features[::2], histories[::2], min_length=70)[:, 0]
    np.testing.assert_allclose(half, alone[::2], rtol=0, atol=1e-6)


@pytest.mark.parametrize("length", [1, 7])
def test_empty_history_gives_finite_scores(session: ort.InferenceSession, length: int) -> None:
    features = generate(16, seed=HELD_OUT_SEED + 2).features
    feed = {
        "features": features,
        "history": np.zeros((16, length, len(HISTORY_FIELDS)), np.float32),
        "history_mask": np.zeros((16, length), np.float32),
    }
    scores = session.run(["score"], feed)[0]
    assert scores.shape == (16, 1)
    assert np.isfinite(scores).all() and (scores >= 0).all() and (scores <= 1).all()


def test_manifest_matches_the_onnx_graph(session: ort.InferenceSession) -> None:
    manifest = load_manifest(MODEL_DIR)
    assert (manifest.name, manifest.version) == ("fraud-demo", "1")
    assert manifest.features == FEATURE_NAMES
    assert manifest.history is not None and manifest.history.fields == HISTORY_FIELDS
    assert manifest.history.max_length == 256 and manifest.history.min_padded_length == 1
    assert manifest.nan_policy == "reject" and manifest.fallback_decision == "REVIEW"
    assert 0.0 < manifest.thresholds.review < manifest.thresholds.decline < 1.0
    inputs = {i.name: i for i in session.get_inputs()}
    assert set(inputs) == {
        manifest.features_input,
        manifest.history.input,
        manifest.history.mask_input,
    }
    assert inputs[manifest.features_input].shape[1] == len(FEATURE_NAMES)
    assert inputs[manifest.history.input].shape[2] == len(HISTORY_FIELDS)
    assert all(i.type == "tensor(float)" for i in inputs.values())
    batch_dim = inputs[manifest.features_input].shape[0]
    history_batch_dim, length_dim = inputs[manifest.history.input].shape[:2]
    assert isinstance(batch_dim, str) and isinstance(length_dim, str)
    # The history has a batch of its own: the graph broadcasts it over the feature rows.
    assert manifest.history.broadcast and history_batch_dim == "history_batch" != batch_dim
    assert inputs[manifest.history.mask_input].shape == [history_batch_dim, length_dim]
    (output,) = session.get_outputs()
    assert output.name == manifest.output and output.shape[1] == 1
    for precision in ("fp16", "int8"):
        for profile in manifest.profiles[precision]:
            assert profile.batch[2] <= manifest.max_batch_size
            assert profile.history_length is not None
            assert profile.history_length[2] <= manifest.history.max_length
    assert (MODEL_DIR / "model.onnx").stat().st_size < 5_000_000


def test_calibration_file_is_valid_model_input(session: ort.InferenceSession) -> None:
    manifest = load_manifest(MODEL_DIR)
    assert manifest.calibration is not None
    with np.load(MODEL_DIR / manifest.calibration) as npz:
        feed = {k: npz[k] for k in ("features", "history", "history_mask")}
    assert feed["features"].shape == (512, len(FEATURE_NAMES))
    assert feed["history"].shape[0] == 512 and feed["history"].shape[2] == len(HISTORY_FIELDS)
    assert all(v.dtype == np.float32 for v in feed.values())
    scores = session.run(["score"], feed)[0]
    assert np.isfinite(scores).all() and (scores >= 0).all() and (scores <= 1).all()
