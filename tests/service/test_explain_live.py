"""Reason codes through real Score calls: exact on linear models, stable on the demo model."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
from google.protobuf import json_format
from liveserver import LiveServer
from modelkit import write_sequence_model, write_tabular_model
from onnx import numpy_helper

from demo.generator import FEATURE_NAMES, generate
from engines.manifest import load_manifest
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

DEMO = Path(__file__).resolve().parents[2] / "models" / "fraud-demo"

# Logistic regression f0..f4: f0 and f1 share code A (occluded together), f4 has no code.
TABULAR_EXPLANATIONS = {
    "features": {
        "f0": {"baseline": 0.5, "code": "A", "text": "first pair"},
        "f1": {"baseline": -0.25, "code": "A"},
        "f2": {"baseline": 1.0, "code": "B", "text": "third"},
        "f3": {"baseline": 0.0, "code": "C", "text": "fourth"},
        "f4": {"baseline": 2.0},
    }
}
SEQUENCE_EXPLANATIONS = {
    "features": {
        "x0": {"baseline": 0.0, "code": "X", "text": "x0 and x1"},
        "x1": {"baseline": 0.0, "code": "X"},
        "x2": {"baseline": 0.3, "code": "Y", "text": "x2"},
    },
    "history": {"baseline": "empty", "code": "H", "text": "recent history"},
}


def _declare(model_dir: Path, explanations: dict) -> Path:
    path = model_dir / "manifest.json"
    data = json.loads(path.read_text())
    data["explanations"] = explanations
    path.write_text(json.dumps(data))
    return model_dir


def _weights(model_dir: Path) -> dict[str, np.ndarray]:
    model = onnx.load(model_dir / "model.onnx")
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("explain-models")
    (root / "fraud-demo").symlink_to(DEMO, target_is_directory=True)
    _declare(write_tabular_model(root, name="lr-explained"), TABULAR_EXPLANATIONS)
    _declare(write_sequence_model(root, name="seq-explained"), SEQUENCE_EXPLANATIONS)
    # The same weights, declared to broadcast its history: explained against one history.
    _declare(write_sequence_model(root, name="seq-shared", broadcast=True), SEQUENCE_EXPLANATIONS)
    write_tabular_model(root, name="lr-plain")
    _demo_repeating_its_history(root / "fraud-demo-repeated" / "1")
    return root


def _demo_repeating_its_history(folder: Path) -> None:
    """The demo model under another name, without `history.broadcast`: every occlusion row
    carries its own copy of the history, as for a model that cannot broadcast."""
    folder.mkdir(parents=True)
    for name in ("model.onnx", "calibration.npz"):
        (folder / name).symlink_to(DEMO / "1" / name)
    data = json.loads((DEMO / "1" / "manifest.json").read_text())
    data["name"] = "fraud-demo-repeated"
    data["history"]["broadcast"] = False
    data["variants"] = {}
    (folder / "manifest.json").write_text(json.dumps(data))


@pytest.fixture(scope="module")
def server(models):
    with LiveServer(models_dir=models, budget_ms=5000, onnx_variants=False) as live:
        yield live


@pytest.fixture(scope="module")
def stub(server):
    with server.channel() as channel:
        yield pb_grpc.RiskScoringStub(channel)


def _expected(pairs: dict[str, float]) -> list[tuple[str, float]]:
    adverse = [(code, c) for code, c in pairs.items() if c > 1e-4]
    return sorted(adverse, key=lambda item: (-item[1], item[0]))


def _check(reply: pb.ScoreResponse, want: list[tuple[str, float]]) -> None:
    got = [(r.code, r.contribution) for r in reply.reasons]
    assert [c for c, _ in got] == [c for c, _ in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert abs(g - w) <= 2e-4


@pytest.mark.parametrize("seed", range(6))
def test_logistic_regression_contributions_are_coefficient_times_offset(stub, models, seed):
    w = _weights(models / "lr-explained" / "1")["w"].reshape(-1).astype(np.float64)
    x = np.random.default_rng(seed).normal(0.0, 1.0, 5)
    base = {n: e["baseline"] for n, e in TABULAR_EXPLANATIONS["features"].items()}
    b = np.array([base[f"f{i}"] for i in range(5)])
    terms = w * (x.astype(np.float32).astype(np.float64) - b)
    if not _expected({"A": terms[0] + terms[1], "B": terms[2], "C": terms[3]}):
        x = 2 * b - x  # every term changes sign, so some become adverse
        terms = w * (x.astype(np.float32).astype(np.float64) - b)
    want = _expected({"A": terms[0] + terms[1], "B": terms[2], "C": terms[3]})
    assert want
    request = pb.ScoreRequest(
        request_id=f"lr{seed}",
        model="lr-explained",
        features={f"f{i}": float(v) for i, v in enumerate(x)},
        explain_top_k=3,
        explain_when=pb.EXPLAIN_ALWAYS,
    )
    reply = stub.Score(request, timeout=10)
    _check(reply, want)
    texts = {"A": "first pair", "B": "third", "C": "fourth"}
    features = {"A": ["f0", "f1"], "B": ["f2"], "C": ["f3"]}
    for reason in reply.reasons:
        assert reason.text == texts[reason.code]
        assert list(reason.features) == features[reason.code]
    # The block (row + one row per code) was one engine batch, and the score is the plain one.
    assert reply.timings.batch_size >= 4
    plain = stub.Score(pb.ScoreRequest(model="lr-explained", features=request.features), timeout=10)
    assert abs(plain.score - reply.score) <= 1e-6 and not plain.reasons


def test_top_k_keeps_the_largest(stub):
    features = {"f0": 3.0, "f1": -3.0, "f2": 3.0, "f3": 3.0, "f4": 0.0}
    full, one = (
        stub.Score(
            pb.ScoreRequest(
                model="lr-explained",
                features=features,
                explain_top_k=k,
                explain_when=pb.EXPLAIN_ALWAYS,
            ),
            timeout=10,
        )
        for k in (10, 1)
    )
    assert len(full.reasons) >= 1
    assert [r.code for r in one.reasons] == [full.reasons[0].code]
    contributions = [r.contribution for r in full.reasons]
    assert contributions == sorted(contributions, reverse=True)
    assert all(c > 0 for c in contributions)


@pytest.mark.parametrize("model", ["seq-explained", "seq-shared"])
@pytest.mark.parametrize("seed", range(4))
def test_history_group_contribution_is_its_mean_term(stub, models, seed, model):
    """seq-mini: logit = x.w + mean over real rows of (h.v); emptying the history removes the
    mean term, so the history group's contribution is exactly that term, whether the block's
    rows carry the history each (seq-explained) or share one (seq-shared)."""
    weights = _weights(models / "seq-explained" / "1")
    w = weights["w"].reshape(-1).astype(np.float64)
    v = weights["v"].reshape(-1).astype(np.float64)
    rng = np.random.default_rng(100 + seed)
    x = rng.normal(0.0, 1.0, 4).astype(np.float32)
    history = rng.normal(0.0, 1.0, (int(rng.integers(1, 12)), 3)).astype(np.float32)
    xd = x.astype(np.float64)
    want = _expected(
        {
            "X": w[0] * xd[0] + w[1] * xd[1],
            "Y": w[2] * (xd[2] - np.float64(np.float32(0.3))),
            "H": float((history.astype(np.float64) @ v).mean()),
        }
    )
    reply = stub.Score(
        pb.ScoreRequest(
            model=model,
            features={f"x{i}": float(val) for i, val in enumerate(x)},
            history=[pb.HistoryRow(values=row.tolist()) for row in history],
            explain_top_k=5,
            explain_when=pb.EXPLAIN_ALWAYS,
        ),
        timeout=10,
    )
    _check(reply, want)
    for reason in reply.reasons:
        if reason.code == "H":
            assert list(reason.features) == ["history"]
    # The row and codes X, Y, H: one batch (seq-shared: the row, X and Y against the one
    # history, then H's row with the history emptied, in the same job).
    assert reply.timings.batch_size == 4


def _demo_request(data, i: int, **explain) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=f"d{i}",
        entity_id=data.entity_ids[i],
        features={n: float(v) for n, v in zip(FEATURE_NAMES, data.features[i], strict=True)},
        history=[pb.HistoryRow(values=row.tolist()) for row in data.histories[i]],
        **explain,
    )


@pytest.fixture(scope="module")
def demo_data():
    return generate(400, seed=424242)


def test_demo_reasons_are_the_same_under_concurrent_load(stub, demo_data):
    """The same request, sent many times among other traffic, gets identical reasons."""
    flagged = int(np.flatnonzero(demo_data.labels == 1)[0])
    explained = _demo_request(demo_data, flagged, explain_top_k=4, explain_when=pb.EXPLAIN_ALWAYS)
    others = [_demo_request(demo_data, i) for i in range(60)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        mine = [pool.submit(stub.Score, explained, timeout=30) for _ in range(24)]
        for other in others:
            pool.submit(stub.Score, other, timeout=30)
        replies = [f.result() for f in mine]
    first = [(r.code, r.text, tuple(r.features), r.contribution) for r in replies[0].reasons]
    assert first, "a reported fraud of the demo data has adverse reasons"
    for reply in replies[1:]:
        assert [(r.code, r.text, tuple(r.features), r.contribution) for r in reply.reasons] == first


def test_demo_adverse_mode_explains_review_and_decline_only(stub, demo_data):
    manifest = load_manifest(DEMO / "1")
    seen = set()
    for i in range(120):
        reply = stub.Score(
            _demo_request(demo_data, i, explain_top_k=3, explain_when=pb.EXPLAIN_ADVERSE),
            timeout=10,
        )
        decision = manifest.thresholds.decide(reply.score)
        seen.add(decision)
        if decision == "APPROVE":
            assert not reply.reasons
        else:
            assert 1 <= len(reply.reasons) <= 3
            for reason in reply.reasons:
                assert reason.text and reason.features and reason.contribution > 0
        if len(seen) == 3:
            break
    assert {"APPROVE", "REVIEW"} <= seen or {"APPROVE", "DECLINE"} <= seen


def test_demo_block_is_one_batch_of_fifteen_rows(stub, demo_data):
    """Always-mode: the row and one row per code (14 codes) in one batch, alone: the demo
    broadcasts its history, so the row and the 13 codes that keep it run against one history,
    then the history code's row with the history emptied."""
    reply = stub.Score(
        _demo_request(demo_data, 1, explain_top_k=14, explain_when=pb.EXPLAIN_ALWAYS), timeout=10
    )
    assert reply.timings.batch_size == 15
    plain = stub.Score(_demo_request(demo_data, 1), timeout=10)
    assert abs(plain.score - reply.score) <= 1e-5


def test_demo_reasons_against_one_history_equal_those_of_repeated_histories(stub, demo_data):
    """The same model and requests, with and without `history.broadcast`: the same reasons,
    in the same order, with the same contributions (to the ranking's rounding)."""
    flagged = np.flatnonzero(demo_data.labels == 1)[:6]
    for i in flagged:
        request = _demo_request(demo_data, int(i), explain_top_k=14, explain_when=pb.EXPLAIN_ALWAYS)
        shared = stub.Score(request, timeout=10)
        request.model = "fraud-demo-repeated"
        repeated = stub.Score(request, timeout=10)
        assert repeated.timings.batch_size == 15
        assert [r.code for r in shared.reasons] == [r.code for r in repeated.reasons]
        assert shared.reasons, "a reported fraud of the demo data has adverse reasons"
        for a, b in zip(shared.reasons, repeated.reasons, strict=True):
            assert abs(a.contribution - b.contribution) <= 2e-4


def _status(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_explain_refused_where_it_cannot_be_given(stub):
    features = {f"f{i}": 0.1 for i in range(5)}
    error = _status(
        lambda: stub.Score(
            pb.ScoreRequest(model="lr-plain", features=features, explain_top_k=2), timeout=10
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "explain_top_k" in error.details() and "no reason codes" in error.details()
    error = _status(
        lambda: stub.ScoreBatch(
            pb.ScoreBatchRequest(
                model="lr-explained",
                requests=[
                    pb.ScoreRequest(features=features),
                    pb.ScoreRequest(features=features, explain_top_k=1),
                ],
            ),
            timeout=10,
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "requests[1].explain_top_k" in error.details()
    error = _status(
        lambda: stub.Score(
            pb.ScoreRequest(
                model="lr-explained", features=features, explain_top_k=1, explain_when=7
            ),
            timeout=10,
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "explain_when" in error.details()


def test_cli_explain_prints_the_reasons(server, demo_data):
    flagged = int(np.flatnonzero(demo_data.labels == 1)[0])
    request = json_format.MessageToJson(_demo_request(demo_data, flagged))
    done = subprocess.run(
        [sys.executable, "-m", "service", "score", "--target", server.target, "--explain", "-"],
        input=request,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    reasons = json.loads(done.stdout)["reasons"]
    assert 1 <= len(reasons) <= 3
    for reason in reasons:  # on stdout with the score, and nowhere else
        assert reason["code"] and reason["text"] and reason["contribution"] > 0
        assert reason["text"] not in done.stderr


def test_server_setting_decides_when_the_request_does_not(stub, models):
    """An APPROVE (score well below review 0.5) asking with EXPLAIN_WHEN_UNSPECIFIED: the default
    server (adverse) gives no reasons, a server set to `always` does."""
    w = _weights(models / "lr-explained" / "1")["w"].reshape(-1)
    # Every coded term positive (adverse) but small: the score stays an APPROVE.
    x = {f"f{i}": float(b + 0.05 * np.sign(w[i])) for i, b in enumerate((0.5, -0.25, 1.0, 0.0))}
    x["f4"] = float(-4.0 * np.sign(w[4]))
    request = pb.ScoreRequest(model="lr-explained", features=x, explain_top_k=3)
    adverse = stub.Score(request, timeout=10)
    assert pb.Decision.Name(adverse.decision) == "APPROVE" and not adverse.reasons
    with (
        LiveServer(models_dir=models, budget_ms=5000, explain_when="always") as always,
        always.channel() as channel,
    ):
        reply = pb_grpc.RiskScoringStub(channel).Score(request, timeout=10)
    assert pb.Decision.Name(reply.decision) == "APPROVE"
    assert [r.code for r in reply.reasons] and all(r.contribution > 0 for r in reply.reasons)
