"""The shipped champion/challenger experiment: `fraud-demo` 1 (the neural net) against the
gradient-boosted version 2, served from demo/experiment as docs/shadow.md runs it."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
from liveserver import server_process
from waiting import wait_until

from demo.generator import FEATURE_NAMES, generate, model_inputs
from engines.manifest import load_manifest
from engines.output import resolve_score_output
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.shadow import NoRecords, read_records

EXPERIMENT = Path(__file__).resolve().parents[2] / "demo" / "experiment"
CHALLENGER = EXPERIMENT / "fraud-demo" / "2"
ROWS = 60


def test_the_challenger_reads_the_fraud_class_of_its_zipmap_output():
    manifest = load_manifest(CHALLENGER)
    score = resolve_score_output(CHALLENGER / "model.onnx", manifest)
    assert score.column == 1 and score.classes == (0, 1) and score.added
    champion = load_manifest(EXPERIMENT / "fraud-demo" / "1")
    # The same request serves both arms: same features, same history fields.
    assert manifest.features == champion.features
    assert manifest.history is not None and champion.history is not None
    assert manifest.history.fields == champion.history.fields


def _records(logs: Path) -> list[dict]:
    try:
        return read_records(str(logs)).to_pylist()
    except NoRecords:
        return []


def test_shadow_experiment_logs_the_challengers_scores(tmp_path: Path):
    data = generate(ROWS, seed=77)
    requests = [
        pb.ScoreRequest(
            request_id=f"r{i}",
            entity_id=data.entity_ids[i],
            features=dict(zip(FEATURE_NAMES, data.features[i].tolist(), strict=True)),
            history=[pb.HistoryRow(values=row.tolist()) for row in data.histories[i]],
        )
        for i in range(ROWS)
    ]
    maps = ort.InferenceSession(
        str(CHALLENGER / "model.onnx"), providers=["CPUExecutionProvider"]
    ).run(["probabilities"], model_inputs(data))[0]
    want = {f"r{i}": m[1] for i, m in enumerate(maps)}
    logs = tmp_path / "logs"
    env = {
        "RISKSERVE_EXPERIMENTS_FILE": str(EXPERIMENT / "experiments.json"),
        "RISKSERVE_SHADOW_LOG_PREFIX": str(logs),
        "RISKSERVE_SHADOW_FLUSH_INTERVAL_S": "0.1",
        "RISKSERVE_SHADOW_MAX_FILE_AGE_S": "0.2",
        "RISKSERVE_SHADOW_MIN_SAMPLED_SHARE": "1",  # every copy, however busy the machine
        "RISKSERVE_BUDGET_MS": "2000",
        "RISKSERVE_ONNX_VARIANTS": "false",
    }
    with server_process(EXPERIMENT, **env) as (_, target), grpc.insecure_channel(target) as ch:
        stub = pb_grpc.RiskScoringStub(ch)
        replies = [stub.Score(r, timeout=10) for r in requests]
        assert {r.model_version for r in replies} == {"1"}  # the champion answers
        wait_until(
            lambda: len([r for r in _records(logs) if r["arm"] == "challenger"]) >= ROWS,
            timeout_s=60,
        )
    challenger = {r["request_id"]: r for r in _records(logs) if r["arm"] == "challenger"}
    assert set(challenger) == set(want)
    got = np.array([challenger[k]["score"] for k in sorted(want)])
    assert np.abs(got - np.array([want[k] for k in sorted(want)])).max() <= 1e-5
    assert {challenger[k]["version"] for k in want} == {"2"}
    # The experiments file in the docs is the one shipped here.
    docs = (EXPERIMENT.parents[1] / "docs" / "shadow.md").read_text()
    shipped = json.loads((EXPERIMENT / "experiments.json").read_text())
    assert json.dumps(shipped, indent=2) in docs
