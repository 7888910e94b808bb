"""Tree ensembles, scorecards and scikit-learn classifiers, exported as their users export them,
served on a real server: every scoring RPC answers the library's own probability of the risk
class, and a class-probability output with no declared risk class is refused at load."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from liveserver import LiveServer

from demo.families import EXPORTS, FEATURES, Exported, dataset, export, write_version
from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.errors import Unavailable

MODEL = "family"
TOLERANCE = 1e-5
OIP_ROWS = 50  # rows a ModelInfer request carries


@pytest.fixture(
    scope="module", params=EXPORTS, ids=lambda p: f"{p[0]}-{'zipmap' if p[1] else 'tensor'}"
)
def exported(request, tmp_path_factory) -> Exported:
    family, zipmap = request.param
    return export(family, zipmap, tmp_path_factory.mktemp("export"))


def score_request(i: int, row: np.ndarray) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=str(i),
        entity_id=f"acct-{i}",
        model=MODEL,
        features={name: float(v) for name, v in zip(FEATURES, row, strict=True)},
    )


def infer_request(start: int, rows: np.ndarray, input_name: str, output: str):
    message = oip.ModelInferRequest(model_name=MODEL, id=str(start))
    message.inputs.add(name=input_name, datatype="FP32", shape=list(rows.shape))
    message.raw_input_contents.append(rows.astype("<f4").tobytes())
    message.outputs.add(name=output)
    return message


def oip_scores(response: oip.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(response.raw_output_contents[0], dtype="<f4")


def test_every_rpc_scores_the_risk_class_as_the_library_does(exported, tmp_path: Path):
    write_version(exported, tmp_path, MODEL)
    _, _, held_out = dataset()
    want = exported.risk_scores(held_out)
    ids = range(len(held_out))
    requests = [score_request(i, row) for i, row in zip(ids, held_out, strict=True)]
    live = LiveServer(models_dir=tmp_path, default_model=MODEL, budget_ms=5000)
    with live, live.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        oip_stub = oip_grpc.GRPCInferenceServiceStub(channel)
        metadata = oip_stub.ModelMetadata(oip.ModelMetadataRequest(name=MODEL), timeout=10)
        (output,) = metadata.outputs
        assert (output.name, output.datatype, list(output.shape)) == ("score", "FP32", [-1, 1])

        unary = [stub.Score(r, timeout=10) for r in requests]
        batches = [
            stub.ScoreBatch(pb.ScoreBatchRequest(model=MODEL, requests=requests[s : s + 64]))
            for s in range(0, len(requests), 64)
        ]
        streamed = {r.request_id: r for r in stub.ScoreStream(iter(requests), timeout=60)}
        chunks = [
            infer_request(s, held_out[s : s + OIP_ROWS], exported.input_name, output.name)
            for s in range(0, len(held_out), OIP_ROWS)
        ]
        inferred = [oip_stub.ModelInfer(c, timeout=10) for c in chunks]
        stream_inferred = {
            r.infer_response.id: r for r in oip_stub.ModelStreamInfer(iter(chunks), timeout=60)
        }

    got = {
        "Score": np.array([r.score for r in unary]),
        "ScoreBatch": np.array([r.score for b in batches for r in b.responses]),
        "ScoreStream": np.array([streamed[str(i)].score for i in ids]),
        "ModelInfer": np.concatenate([oip_scores(r) for r in inferred]),
        "ModelStreamInfer": np.concatenate(
            [oip_scores(stream_inferred[c.id].infer_response) for c in chunks]
        ),
    }
    for rpc, scores in got.items():
        assert scores.shape == want.shape, rpc
        assert np.abs(scores - want).max() <= TOLERANCE, rpc
    decisions = {r.decision for r in unary}
    assert len(decisions) > 1  # the held-out rows span more than one decision
    assert all(r.engine == "onnxruntime-cpu" for r in unary)


def test_an_undeclared_risk_class_is_refused_at_load(exported, tmp_path: Path):
    write_version(exported, tmp_path, MODEL, risk_class=None)
    server = LiveServer(models_dir=tmp_path, default_model=MODEL)
    with pytest.raises(Unavailable) as refused:
        server.__enter__()
    server.stop()
    message = str(refused.value)
    assert f"output {exported.probability_output!r}" in message
    assert "classes [0, 1]" in message and "`risk_class`" in message


def test_one_refused_version_stops_no_other_from_serving(tmp_path: Path, caplog):
    exported = export("logistic", False, tmp_path / "export")
    write_version(exported, tmp_path, MODEL, risk_class=None)
    write_version(exported, tmp_path, "declared")
    caplog.set_level(logging.ERROR, logger="service.models.registry")
    live = LiveServer(models_dir=tmp_path, default_model="declared")
    with live, live.channel() as channel:
        oip_stub = oip_grpc.GRPCInferenceServiceStub(channel)
        assert oip_stub.ModelReady(oip.ModelReadyRequest(name="declared"), timeout=10).ready
        assert not oip_stub.ModelReady(oip.ModelReadyRequest(name=MODEL), timeout=10).ready
        assert oip_stub.ServerReady(oip.ServerReadyRequest(), timeout=10).ready
        request = score_request(0, np.zeros(len(FEATURES)))
        request.model = "declared"
        assert pb_grpc.RiskScoringStub(channel).Score(request, timeout=10).model == "declared"
    (refusal,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert refusal.startswith("not served: ") and "`risk_class`" in refusal
    assert "\n" not in refusal


# LightGBM, exported with the converter's default ZipMap: codes over pairs and single features.
GROUPS = {"A": ("f0", "f1"), "B": ("f2",), "C": ("f3", "f4"), "D": ("f5",)}


def _logit(p: float) -> float:
    p = min(max(p, 1e-7), 1 - 1e-7)
    return float(np.log(p) - np.log1p(-p))


def test_gradient_boosted_reasons_are_adverse_deterministic_and_exact(tmp_path: Path):
    exported = export("lightgbm", True, tmp_path / "export")
    train, _, held_out = dataset()
    medians = np.median(train, axis=0)
    explanations = {
        "features": {
            name: {"baseline": float(medians[FEATURES.index(name)]), "code": code}
            | ({"text": f"group {code}"} if i == 0 else {})
            for code, names in GROUPS.items()
            for i, name in enumerate(names)
        }
    }
    write_version(exported, tmp_path, MODEL, explanations=explanations)
    live = LiveServer(models_dir=tmp_path, default_model=MODEL, budget_ms=5000)
    checked = 0
    with live, live.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        for i, row in enumerate(held_out[:40]):
            request = score_request(i, row)
            request.explain_top_k = len(GROUPS)
            request.explain_when = pb.EXPLAIN_ADVERSE
            reply = stub.Score(request, timeout=10)
            again = stub.Score(request, timeout=10)
            assert [(r.code, r.contribution) for r in reply.reasons] == [
                (r.code, r.contribution) for r in again.reasons
            ]
            if reply.decision == pb.APPROVE:
                assert not reply.reasons  # adverse mode explains adverse decisions only
                continue
            want = {}
            for code, names in GROUPS.items():
                occluded = row.copy()
                for name in names:
                    occluded[FEATURES.index(name)] = medians[FEATURES.index(name)]
                alone = stub.Score(score_request(10_000 + i, occluded), timeout=10).score
                # Ranked as the server ranks them: in steps of 1e-4 logits.
                want[code] = round((_logit(reply.score) - _logit(alone)) / 1e-4) * 1e-4
            adverse = sorted(
                ((c, w) for c, w in want.items() if w > 0), key=lambda cw: (-cw[1], cw[0])
            )
            assert [r.code for r in reply.reasons] == [c for c, _ in adverse]
            for reason, (_, contribution) in zip(reply.reasons, adverse, strict=True):
                assert reason.contribution > 0
                assert abs(reason.contribution - contribution) <= 2e-4
                assert list(reason.features) == list(GROUPS[reason.code])
            checked += bool(reply.reasons)
    assert checked >= 3  # enough adverse rows with reasons to mean something
