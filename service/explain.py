"""Reason codes by batched occlusion: why a score is as high as it is.

An explained request becomes one block of rows for the micro-batcher: the request's own row, then
one row per reason code of the manifest with that code's features set to their baselines (and,
for the history group, the history emptied). The batcher keeps a block together, so the whole
explanation is one engine call under the request's deadline. A code's contribution is
``logit(score) - logit(score of its occluded row)``: how much higher, in log-odds, the score is
with the features as they are than with them at their baselines. docs/explanations.md says what
that does and does not mean.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from engines.manifest import Manifest
from riskscoring.v1 import risk_scoring_pb2 as pb
from service.batcher import Scored
from service.codec import RowBatch
from service.errors import InvalidRequest

__all__ = [
    "Explainer",
    "Reason",
    "TopReasonComparison",
    "check_batch",
    "compare_top_reasons",
    "encode_reasons",
    "log_codes",
    "score_explained",
]

ExplainWhen = Literal["always", "adverse"]
Submit = Callable[[RowBatch, float], Awaitable[Scored]]

# Contributions are rounded to this many logits before ranking, so that float noise between
# batches of different shapes (about 1e-6) cannot swap two reasons of equal weight.
_QUANTUM = 1e-4
# Scores are clipped this far from 0 and 1 before the logit (float32 reaches 1.0 exactly).
_EPS = 1e-7
_ADVERSE = ("REVIEW", "DECLINE")


@dataclass(frozen=True, slots=True)
class Reason:
    """One adverse reason: a code, its text, the features behind it and its logit contribution."""

    code: str
    text: str
    features: tuple[str, ...]
    contribution: float


class Explainer:
    """A model's reason codes as arrays: builds occlusion blocks and ranks their scores."""

    def __init__(self, manifest: Manifest) -> None:
        self.codes = manifest.reason_codes
        index = {name: i for i, name in enumerate(manifest.features)}
        n = len(self.codes)
        self._occluded = np.zeros((n, manifest.n_features), dtype=bool)
        self._baselines = np.zeros((n, manifest.n_features), dtype=np.float32)
        for i, code in enumerate(self.codes):
            columns = [index[f] for f in code.features]
            self._occluded[i, columns] = True
            self._baselines[i, columns] = code.baselines
        self._no_history = np.array([c.history for c in self.codes], dtype=bool)
        self._features = tuple(c.features + (("history",) if c.history else ()) for c in self.codes)

    @property
    def block_rows(self) -> int:
        return 1 + len(self.codes)

    def block(self, rows: RowBatch) -> RowBatch:
        """The one-row `rows`, then one row per code with that code's inputs at baseline."""
        assert rows.rows == 1, "a block explains one row"
        n = self.block_rows
        features = np.empty((n, rows.features.shape[1]), dtype=np.float32)
        features[0] = rows.features[0]
        features[1:] = np.where(self._occluded, self._baselines, rows.features[0])
        if rows.history is None or rows.mask is None:
            return RowBatch(features, None, None)
        history = np.broadcast_to(rows.history, (n, *rows.history.shape[1:])).copy()
        mask = np.broadcast_to(rows.mask, (n, rows.mask.shape[1])).copy()
        mask[1:][self._no_history] = 0.0
        history[1:][self._no_history] = 0.0
        return RowBatch(features, history, mask)

    def reasons(self, scores: np.ndarray, top_k: int) -> tuple[Reason, ...]:
        """The `top_k` adverse reasons from a block's scores, largest first, ties by code."""
        if top_k <= 0 or not np.isfinite(scores).all():
            return ()
        logits = _logit(scores)
        ranked = []
        for i, code in enumerate(self.codes):
            contribution = round((logits[0] - logits[1 + i]) / _QUANTUM) * _QUANTUM
            if contribution > 0:
                ranked.append((-contribution, code.code, i))
        ranked.sort()
        return tuple(
            Reason(self.codes[i].code, self.codes[i].text, self._features[i], -negative)
            for negative, _, i in ranked[:top_k]
        )


def _logit(scores: np.ndarray) -> np.ndarray:
    p = np.clip(scores.astype(np.float64), _EPS, 1.0 - _EPS)
    return np.log(p) - np.log1p(-p)


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
            or manifest.thresholds.decide(score) not in _ADVERSE
        ):
            return scored, ()
        block = await submit(explainer.block(rows), deadline)
        return scored, explainer.reasons(block.scores, top_k)
    block = await submit(explainer.block(rows), deadline)
    own = dataclasses.replace(block, scores=block.scores[:1], row_engines=block.row_engines[:1])
    return own, explainer.reasons(block.scores, top_k)


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


def log_codes(reasons: Sequence[Reason], top_k: int = 3) -> list[str]:
    """The compact form a log record carries: the top codes, largest contribution first."""
    return [r.code for r in reasons[:top_k]]


@dataclass(frozen=True, slots=True)
class TopReasonComparison:
    """How often champion and challenger name a different top reason for the same request."""

    pairs: int  # requests where both arms gave at least one reason
    differing: int

    @property
    def share(self) -> float | None:
        return self.differing / self.pairs if self.pairs else None


def compare_top_reasons(
    champion: Sequence[Sequence[str]], challenger: Sequence[Sequence[str]]
) -> TopReasonComparison:
    """Compare the arms' code lists (as `log_codes` writes them), paired by request.

    Only requests where both arms gave a reason count: an arm without reasons (it approved, in
    adverse-only mode) says nothing about which reason comes first.
    """
    if len(champion) != len(challenger):
        raise ValueError(f"{len(champion)} champion records, {len(challenger)} challenger")
    pairs = differing = 0
    for ours, theirs in zip(champion, challenger, strict=True):
        if ours and theirs:
            pairs += 1
            differing += ours[0] != theirs[0]
    return TopReasonComparison(pairs, differing)
