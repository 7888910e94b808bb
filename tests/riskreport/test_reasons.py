"""Reason codes in the experiment log: both arms explained alike, and the report's comparison."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pyarrow.parquet as pq
import pytest
from liveserver import experiment_server
from modelkit import sequence_request, write_sequence_model
from waiting import wait_until

from riskreport import build_report, render_html, render_summary
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.shadow import ExperimentRecord, NoRecords, read_records
from service.shadow.record import records_to_table

MODEL = "seq-mini"
EXPLANATIONS = {
    "features": {
        "x0": {"baseline": 0.0, "code": "X", "text": "x0 and x1"},
        "x1": {"baseline": 0.0, "code": "X"},
        "x2": {"baseline": 0.3, "code": "Y", "text": "x2"},
        "x3": {"baseline": -0.2, "code": "Z", "text": "x3"},
    },
    "history": {"baseline": "empty", "code": "H", "text": "recent history"},
}


def _declare(model_dir: Path) -> Path:
    path = model_dir / "manifest.json"
    data = json.loads(path.read_text())
    data["explanations"] = EXPLANATIONS
    path.write_text(json.dumps(data))
    return model_dir


@pytest.fixture()
def models(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    _declare(write_sequence_model(root, version="1", seed=1))
    _declare(write_sequence_model(root, version="2", seed=2))
    return root


def request(i: int, when: int, top_k: int = 3) -> pb.ScoreRequest:
    return sequence_request(i, 30, explain_top_k=top_k, explain_when=when)


def expected_codes(model_dir: Path, req: pb.ScoreRequest) -> tuple[float, tuple[str, ...]]:
    """The score and the top three codes, by occluding each code's inputs by hand."""
    session = ort.InferenceSession(
        str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    x = np.array([[req.features[f"x{j}"] for j in range(4)]], np.float32)
    history = np.array([[row.values for row in req.history]], np.float32)
    mask = np.ones((1, len(req.history)), np.float32)
    occluded = {"X": (x * [0, 0, 1, 1], mask), "Y": (x.copy(), mask), "Z": (x.copy(), mask)}
    occluded["Y"][0][0, 2] = 0.3
    occluded["Z"][0][0, 3] = -0.2
    occluded["H"] = (x, np.zeros_like(mask))

    def logit(features: np.ndarray, m: np.ndarray) -> float:
        feed = {"features": features.astype(np.float32), "history": history, "history_mask": m}
        p = float(session.run(["score"], feed)[0].reshape(-1)[0])
        return float(np.log(p) - np.log1p(-p))

    own = logit(x, mask)
    contributions = {code: own - logit(f, m) for code, (f, m) in occluded.items()}
    ranked = sorted((c for c in contributions.items() if c[1] > 0), key=lambda c: (-c[1], c[0]))
    return 1 / (1 + np.exp(-own)), tuple(code for code, _ in ranked[:3])


def records(logs: Path) -> list[dict]:
    try:
        return read_records(str(logs)).drop_columns(["time"]).to_pylist()
    except NoRecords:
        return []


def test_both_arms_log_reasons_and_the_report_counts_top_reason_changes(models, tmp_path):
    config, logs = tmp_path / "experiments.json", tmp_path / "logs"
    config.write_text(
        json.dumps({"models": {MODEL: {"champion": "1", "challengers": ["2"], "mode": "shadow"}}})
    )
    always = [request(i, pb.EXPLAIN_ALWAYS) for i in range(30)]
    adverse = [request(i, pb.EXPLAIN_ADVERSE) for i in range(30, 60)]
    plain = [request(i, pb.EXPLAIN_WHEN_UNSPECIFIED, top_k=0) for i in range(60, 70)]
    with (
        experiment_server(models, config, logs, MODEL) as live,
        live.channel() as channel,
    ):
        stub = pb_grpc.RiskScoringStub(channel)
        replies = {r.request_id: stub.Score(r, timeout=10) for r in always + adverse + plain}
        ids = set(replies)
        wait_until(lambda: sum(r["request_id"] in ids for r in records(logs)) == 2 * len(ids))

    logged = {(r["request_id"], r["arm"]): r for r in records(logs)}
    for req in always + adverse + plain:
        served = logged[(req.request_id, "champion")]
        assert served["reason_codes"] == [r.code for r in replies[req.request_id].reasons][:3]
        challenger = logged[(req.request_id, "challenger")]
        score, codes = expected_codes(models / MODEL / "2", req)
        assert challenger["score"] == pytest.approx(score, abs=1e-5)
        if req in plain or (req in adverse and challenger["decision"] == "APPROVE"):
            assert challenger["reason_codes"] == []
        else:  # explained the same way as the champion, on the challenger's own model
            assert tuple(challenger["reason_codes"]) == codes
    # A score below every baseline's has no adverse reason: most of these have some.
    assert sum(bool(logged[(r.request_id, "champion")]["reason_codes"]) for r in always) > 20
    assert {logged[(r.request_id, "challenger")]["decision"] for r in adverse} > {"APPROVE"}

    # The report's figure, against the same figure counted here from the log.
    pairs = differing = 0
    for req in always + adverse + plain:
        ours = logged[(req.request_id, "champion")]["reason_codes"]
        theirs = logged[(req.request_id, "challenger")]["reason_codes"]
        if ours and theirs:
            pairs += 1
            differing += ours[0] != theirs[0]
    assert pairs > len(always) // 2 and 0 < differing < pairs  # the seeds make both happen
    report = build_report(str(logs))
    (comparison,) = report.comparisons
    assert comparison.top_reason is not None
    assert (comparison.top_reason.pairs, comparison.top_reason.differing) == (pairs, differing)
    share = f"{100 * differing / pairs:.2f}% of {pairs:,} requests where both arms gave reasons"
    assert f"top reason differs: {share}" in render_summary(report)
    assert "top reason differs" in render_html(report)
    assert json.loads(report.to_json())["comparisons"][0]["top_reason"] == {
        "pairs": pairs,
        "differing": differing,
    }


def _record(i: int, arm: str, codes: tuple[str, ...]) -> ExperimentRecord:
    return ExperimentRecord(
        request_id=f"r{i}", entity_id=f"e{i}", experiment="exp", model=MODEL,
        arm=arm, version="1" if arm == "champion" else "2", score=0.1 * (i % 10),
        decision="APPROVE", engine="onnxruntime-cpu", latency_ms=1.0, mode="shadow",
        served=arm == "champion", reason_codes=codes, time_ns=1_700_000_000_000_000_000 + i,
    )  # fmt: skip


def _write(path: Path, rows: list[ExperimentRecord], *, old_schema: bool = False) -> None:
    table = records_to_table([(r, r.time_ns) for r in rows], "replica")
    if old_schema:  # as logged before reason codes were
        table = table.drop_columns(["reason_codes"])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def test_a_log_without_reason_columns_still_reports(tmp_path):
    logs = tmp_path / "logs"
    old = [_record(i, arm, ()) for i in range(20) for arm in ("champion", "challenger")]
    _write(logs / "old" / "part-0.parquet", old, old_schema=True)

    report = build_report(str(logs))
    assert report.records == 40
    assert report.comparisons[0].pairs == 20
    assert report.comparisons[0].top_reason is None  # no record has reasons: no figure
    assert "top reason" not in render_summary(report)
    assert "top reason" not in render_html(report)
    assert all(r["reason_codes"] is None for r in records(logs))

    # Newer files beside the old ones: read together, the old records count as without reasons.
    new = [
        _record(i, arm, codes)
        for i in range(20, 30)
        for arm, codes in (("champion", ("A", "B")), ("challenger", ("A",) if i < 24 else ("B",)))
    ]
    _write(logs / "new" / "part-0.parquet", new)
    report = build_report(str(logs))
    assert report.records == 60
    top = report.comparisons[0].top_reason
    assert top is not None and (top.pairs, top.differing, top.share) == (10, 6, 0.6)
