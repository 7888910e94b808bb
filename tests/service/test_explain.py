"""The occlusion block, the ranking of reasons, and the comparison of two arms' top reasons."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from engines.manifest import Manifest
from riskscoring.v1 import risk_scoring_pb2 as pb
from service.batching.batcher import Scored
from service.batching.rows import RowBatch
from service.explanations.occlusion import (
    Explainer,
    Reason,
    compare_top_reasons,
    log_codes,
    score_explained,
)

MANIFEST = Manifest.model_validate(
    {
        "name": "m",
        "version": "1",
        "features": ["a", "b", "c", "d"],
        "history": {"fields": ["h0", "h1"], "max_length": 8},
        "thresholds": {"review": 0.5, "decline": 0.9},
        "explanations": {
            "features": {
                "a": {"baseline": 10.0, "code": "R2", "text": "a or c"},
                "c": {"baseline": 30.0, "code": "R2"},
                "b": {"baseline": 20.0, "code": "R1", "text": "b"},
                "d": {"baseline": 40.0},
            },
            "history": {"code": "R3", "text": "history"},
        },
    }
)


def _row() -> RowBatch:
    features = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
    history = np.arange(6, dtype=np.float32).reshape(1, 3, 2) + 1
    mask = np.array([[1.0, 1.0, 0.0]], dtype=np.float32)
    return RowBatch(features, history, mask)


def test_block_occludes_each_code_jointly():
    explainer = Explainer(MANIFEST)
    block = explainer.block(_row())
    assert explainer.block_rows == block.rows == 4
    assert block.features.tolist() == [
        [1.0, 2.0, 3.0, 4.0],
        [1.0, 20.0, 3.0, 4.0],  # R1: b
        [10.0, 2.0, 30.0, 4.0],  # R2: a and c together
        [1.0, 2.0, 3.0, 4.0],  # R3: the history only
    ]
    assert block.mask is not None and block.history is not None
    assert block.mask.tolist() == [[1, 1, 0]] * 3 + [[0, 0, 0]]
    assert not block.history[3].any()
    assert (block.history[:3] == _row().history).all()


@pytest.mark.parametrize("history_code", ["R3", "A0"])
def test_blocks_against_one_history_are_the_block_in_another_order(history_code):
    """With `history.broadcast`, the block is sent as the row and the codes that keep the
    history (against the one history), then the codes that empty it; `block_scores` maps the
    scores of those rows back to the block's order, wherever the history's code falls."""
    data = MANIFEST.model_dump()
    data["history"]["broadcast"] = True
    data["explanations"]["history"]["code"] = history_code
    explainer = Explainer(Manifest.model_validate(data))
    row = _row()
    block = explainer.block(row)
    shared, emptied = explainer.blocks(row)
    assert shared.shares_history and shared.rows == 3 and shared.history is row.history
    assert emptied.rows == 1 and emptied.mask is not None and not emptied.mask.any()
    joined = np.concatenate([shared.features, emptied.features])
    order = explainer.block_scores(np.arange(joined.shape[0], dtype=np.float64)).astype(int)
    assert joined[order].tolist() == block.features.tolist()
    # Which rows carry the history, in block order: every one but the history code's.
    carries = np.concatenate([np.ones(shared.rows, bool), np.zeros(emptied.rows, bool)])[order]
    assert carries.tolist() == [bool(m.any()) for m in block.mask]


def _logistic(logits: list[float]) -> np.ndarray:
    return (1 / (1 + np.exp(-np.array(logits)))).astype(np.float32)


def test_reasons_are_adverse_only_ranked_with_ties_by_code():
    explainer = Explainer(MANIFEST)
    # own logit 1.0; R1 row 0.5 (+0.5), R2 row 0.5 (+0.5, a tie), R3 row 2.0 (-1.0)
    reasons = explainer.reasons(_logistic([1.0, 0.5, 0.5, 2.0]), top_k=5)
    assert [r.code for r in reasons] == ["R1", "R2"]
    assert reasons[1].features == ("a", "c") and reasons[1].text == "a or c"
    assert all(abs(r.contribution - 0.5) < 1e-4 for r in reasons)
    assert explainer.reasons(_logistic([1.0, 0.5, 0.5, 2.0]), top_k=1)[0].code == "R1"
    history = explainer.reasons(_logistic([1.0, 1.0, 1.0, -2.0]), top_k=5)
    assert [(r.code, r.features) for r in history] == [("R3", ("history",))]
    assert explainer.reasons(np.full(4, np.nan, dtype=np.float32), top_k=3) == ()


def test_log_codes_and_top_reason_disagreement():
    reasons = [Reason(c, "t", ("a",), 1.0) for c in ("R7", "R2", "R1", "R9")]
    assert log_codes(reasons) == ["R7", "R2", "R1"]
    assert log_codes(reasons, top_k=1) == ["R7"]
    champion = [["R1", "R2"], ["R3"], [], ["R4"], ["R5", "R1"]]
    challenger = [["R1"], ["R2", "R3"], ["R1"], [], ["R1", "R5"]]
    result = compare_top_reasons(champion, challenger)
    # pairs where both gave reasons: 0 (same), 1 (differs), 4 (differs)
    assert (result.pairs, result.differing) == (3, 2)
    assert result.share == pytest.approx(2 / 3)
    assert compare_top_reasons([[]], [["R1"]]).share is None
    with pytest.raises(ValueError, match="2 champion records, 1 challenger"):
        compare_top_reasons([["R1"], ["R2"]], [["R1"]])


def test_an_adverse_decision_whose_reasons_come_too_late_is_the_degraded_answer():
    """EXPLAIN_ADVERSE: the row is scored in time (REVIEW), then its block is degraded by the
    batcher (RISKSERVE_DEGRADE_ON_DEADLINE). The REVIEW is not answered without its reasons:
    the answer is the degraded one, as the row's own would have been."""
    calls: list[int] = []

    async def submit(rows: RowBatch | tuple[RowBatch, ...], deadline: float) -> Scored:
        parts = (rows,) if isinstance(rows, RowBatch) else rows
        n = sum(p.rows for p in parts)
        calls.append(n)
        if len(calls) == 1:
            return Scored(np.full(n, 0.7, np.float32), "e", "", 0.001)  # REVIEW
        return Scored(np.full(n, np.nan, np.float32), "", "deadline", 0.0, degraded=True)

    request = pb.ScoreRequest(explain_top_k=2, explain_when=pb.EXPLAIN_ADVERSE)
    scored, reasons = asyncio.run(
        score_explained(submit, MANIFEST, request, _row(), time.monotonic() + 1, "adverse")
    )
    assert len(calls) == 2 and calls[1] > 1  # the row, then its block
    assert scored.degraded and len(scored.scores) == 1 and reasons == ()
