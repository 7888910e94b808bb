"""Reason codes by batched occlusion: why a score is as high as it is.

An explained request becomes one block of rows for the micro-batcher: the request's own row, then
one row per reason code of the manifest with that code's features set to their baselines (and,
for the history group, the history emptied). The batcher keeps a block together, so the whole
explanation is one engine call under the request's deadline. Where the model broadcasts its
history (`history.broadcast` in the manifest), the rows that keep the request's history are sent
against that one history, so the engine computes it once rather than once per row, and the rows
that empty it are a second part of the same job, run right after. A code's contribution is
``logit(score) - logit(score of its occluded row)``: how much higher, in log-odds, the score is
with the features as they are than with them at their baselines. docs/explanations.md says what
that does and does not mean.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from engines.manifest import Manifest
from riskscoring.v1 import risk_scoring_pb2 as pb
from service.batching.batcher import Scored
from service.batching.rows import RowBatch
from service.errors import InvalidRequest
from service.explanations.reasons import (
    ADVERSE_DECISIONS,
    Explained,
    ExplainWhen,
    Occlusion,
    Reason,
    TopReasonComparison,
    compare_top_reasons,
    log_codes,
)

__all__ = [
    "ExplainWhen",
    "Explainer",
    "Reason",
    "TopReasonComparison",
    "check_batch",
    "compare_top_reasons",
    "encode_reasons",
    "explained",
    "log_codes",
    "score_explained",
]

Submit = Callable[[RowBatch | Sequence[RowBatch], float], Awaitable[Scored]]


class Explainer(Occlusion):
    """`Occlusion` over the request path's `RowBatch`: the blocks of an explained request."""

    def __init__(self, manifest: Manifest) -> None:
        super().__init__(manifest)
        spec = manifest.history
        self._broadcast = spec is not None and spec.broadcast
        self._empty_length = spec.min_padded_length if spec is not None else 1
        self._keeps = ~self.empties_history

    def block(self, rows: RowBatch) -> RowBatch:
        """The one-row `rows`, then one row per code with that code's inputs at baseline."""
        features, history, mask = self.occluded(rows.features, rows.history, rows.mask)
        if history is None or mask is None or rows.history is None or rows.mask is None:
            return RowBatch(np.concatenate([rows.features, features]), None, None)
        return RowBatch(
            np.concatenate([rows.features, features]),
            np.concatenate([rows.history, history]),
            np.concatenate([rows.mask, mask]),
        )

    def blocks(self, rows: RowBatch) -> tuple[RowBatch, ...]:
        """What to score for the one-row `rows`, as the parts of one batcher job: `block`, or
        where the model broadcasts its history, the row and the codes that keep its history
        against that one history, then (if any code empties it) those codes' rows with an empty
        history (the batcher runs such a job alone, each part as it is).
        `block_scores` puts their scores back in `block` order."""
        if not self._broadcast or rows.history is None or rows.mask is None:
            return (self.block(rows),)
        features = self.occluded_features(rows.features)
        shared = RowBatch(
            np.concatenate([rows.features, features[self._keeps]]), rows.history, rows.mask
        )
        emptied = features[~self._keeps]
        if not len(emptied):
            return (shared,)
        n, fields = len(emptied), rows.history.shape[2]
        empty = RowBatch(
            emptied,
            np.zeros((n, self._empty_length, fields), dtype=rows.history.dtype),
            np.zeros((n, self._empty_length), dtype=rows.mask.dtype),
        )
        return shared, empty

    def block_scores(self, scores: np.ndarray) -> np.ndarray:
        """The scores of `blocks`' rows (in their order), in `block` order: the row, then one
        per code."""
        if not self._broadcast or self._keeps.all():
            return scores
        kept = 1 + int(self._keeps.sum())
        out = np.empty(self.block_rows, dtype=scores.dtype)
        out[0] = scores[0]
        by_code = out[1:]
        by_code[self._keeps] = scores[1:kept]
        by_code[~self._keeps] = scores[kept:]
        return out


def explained(
    request: pb.ScoreRequest, default_when: ExplainWhen, reasons: Sequence[Reason]
) -> Explained | None:
    """What a request asked of reasons and the codes it got, for the log; None if it asked none."""
    if request.explain_top_k <= 0:
        return None
    return Explained(request.explain_top_k, _when(request, default_when), tuple(log_codes(reasons)))


# Explainers of the manifests seen, newest last; bounded so reloads cannot grow it.
_explainers: dict[int, tuple[Manifest, Explainer]] = {}
_MAX_EXPLAINERS = 32


def explainer_for(manifest: Manifest) -> Explainer:
    found = _explainers.get(id(manifest))
    if found is not None and found[0] is manifest:
        return found[1]
    explainer = Explainer(manifest)
    if len(_explainers) >= _MAX_EXPLAINERS:
        del _explainers[next(iter(_explainers))]
    _explainers[id(manifest)] = (manifest, explainer)
    return explainer


def _when(request: pb.ScoreRequest, default: ExplainWhen) -> ExplainWhen:
    if request.explain_when == pb.EXPLAIN_ALWAYS:
        return "always"
    if request.explain_when == pb.EXPLAIN_ADVERSE:
        return "adverse"
    return default


async def score_explained(
    submit: Submit,
    manifest: Manifest,
    request: pb.ScoreRequest,
    rows: RowBatch,
    deadline: float,
    default_when: ExplainWhen,
) -> tuple[Scored, tuple[Reason, ...]]:
    """Score one decoded request and, if it asks, explain it; the Scored covers its row only.

    "always": the row and its occlusion rows go to the batcher as one block. "adverse": the
    row alone first; only a REVIEW or DECLINE decision sends the block, under the same deadline.
    """
    if not request.explain_top_k:
        return await submit(rows, deadline), ()
    explainer = explainer_for(manifest)
    if not explainer.codes:
        raise InvalidRequest(
            "explain_top_k", f"model {manifest.name} {manifest.version} declares no reason codes"
        )
    if request.explain_when not in (
        pb.EXPLAIN_WHEN_UNSPECIFIED,
        pb.EXPLAIN_ALWAYS,
        pb.EXPLAIN_ADVERSE,
    ):
        raise InvalidRequest("explain_when", f"unknown value {request.explain_when}")
    top_k = min(request.explain_top_k, len(explainer.codes))
    if _when(request, default_when) == "adverse":
        scored = await submit(rows, deadline)
        score = float(scored.scores[0])
        if (
            scored.degraded
            or math.isnan(score)
            or manifest.thresholds.decide(score) not in ADVERSE_DECISIONS
        ):
            return scored, ()
        block, scores = await _score_blocks(submit, explainer, rows, deadline)
        if block.degraded:
            # The decision asked for its reasons and they came too late: it is not given
            # without them. The block's answer is the fallback decision, marked degraded.
            return dataclasses.replace(
                block, scores=block.scores[:1], row_engines=block.row_engines[:1]
            ), ()
        return scored, explainer.reasons(scores, top_k)
    first, scores = await _score_blocks(submit, explainer, rows, deadline)
    own = dataclasses.replace(first, scores=first.scores[:1], row_engines=first.row_engines[:1])
    return own, explainer.reasons(scores, top_k)


async def _score_blocks(
    submit: Submit, explainer: Explainer, rows: RowBatch, deadline: float
) -> tuple[Scored, np.ndarray]:
    """The job's Scored (the request's own row is its first) and the scores of every
    occlusion row in `Explainer.block` order."""
    scored = await submit(explainer.blocks(rows), deadline)
    return scored, explainer.block_scores(scored.scores)


def check_batch(request: pb.ScoreBatchRequest) -> None:
    """Reasons are given by Score only: a ScoreBatch asking for them is refused."""
    for i, item in enumerate(request.requests):
        if item.explain_top_k:
            raise InvalidRequest(
                f"requests[{i}].explain_top_k", "reasons are given by Score only, not ScoreBatch"
            )


def encode_reasons(reply: pb.ScoreResponse, reasons: Sequence[Reason]) -> None:
    reply.reasons.extend(
        pb.Reason(code=r.code, text=r.text, features=r.features, contribution=r.contribution)
        for r in reasons
    )
