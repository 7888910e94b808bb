"""Reason codes as arrays: occlusion rows, their ranking, and the codes a log record keeps.

numpy and the manifest only, so the shadow worker explains a challenger and the report compares
the arms' codes without loading the server's protobuf or batching modules.
`service.explanations.occlusion` puts this on the request path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from engines.manifest import Manifest

__all__ = [
    "ADVERSE_DECISIONS",
    "ExplainWhen",
    "Explained",
    "Occlusion",
    "Reason",
    "TopReasonComparison",
    "compare_top_reasons",
    "log_codes",
]

ExplainWhen = Literal["always", "adverse"]
ADVERSE_DECISIONS = ("REVIEW", "DECLINE")
"""The decisions "adverse" mode explains."""

# Contributions are rounded to this many logits before ranking, so that float noise between
# batches of different shapes (about 1e-6) cannot swap two reasons of equal weight.
_QUANTUM = 1e-4
# Scores are clipped this far from 0 and 1 before the logit (float32 reaches 1.0 exactly).
_EPS = 1e-7
# A log record keeps at most this many codes, largest contribution first.
LOGGED_CODES = 3


@dataclass(frozen=True, slots=True)
class Reason:
    """One adverse reason: a code, its text, the features behind it and its logit contribution."""

    code: str
    text: str
    features: tuple[str, ...]
    contribution: float


@dataclass(frozen=True, slots=True)
class Explained:
    """What a served request asked of reasons and the codes it was given, for the shadow log."""

    top_k: int
    when: ExplainWhen
    codes: tuple[str, ...]


class Occlusion:
    """A model's reason codes as arrays: the occluded rows of a row, and the ranking of scores.

    A block is the row itself followed by `occluded` rows, one per code (in `codes` order);
    `reasons` ranks a block's scores in that order.
    """

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
        names = [c.code for c in self.codes]
        self._code_rank = np.array([sorted(names).index(name) for name in names], dtype=np.int64)

    @property
    def block_rows(self) -> int:
        return 1 + len(self.codes)

    def occluded(
        self, features: np.ndarray, history: np.ndarray | None, mask: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """One row per code for the one-row arrays given, that code's inputs at baseline."""
        n = len(self.codes)
        rows = self.occluded_features(features)
        if history is None or mask is None:
            return rows, None, None
        histories = np.broadcast_to(history, (n, *history.shape[1:])).copy()
        masks = np.broadcast_to(mask, (n, mask.shape[1])).copy()
        masks[self._no_history] = 0
        histories[self._no_history] = 0
        return rows, histories, masks

    def occluded_features(self, features: np.ndarray) -> np.ndarray:
        """The feature rows of `occluded`: one per code, that code's features at baseline."""
        assert len(features) == 1, "occlusion explains one row"
        return np.where(self._occluded, self._baselines, features[0]).astype(features.dtype)

    @property
    def empties_history(self) -> np.ndarray:
        """Per code (in `codes` order), whether its occluded row has the history emptied."""
        return self._no_history

    def reasons(self, scores: np.ndarray, top_k: int) -> tuple[Reason, ...]:
        """The `top_k` adverse reasons from a block's scores, largest first, ties by code."""
        if top_k <= 0 or not np.isfinite(scores).all():
            return ()
        logits = _logit(scores)
        contributions = np.round((logits[0] - logits[1:]) / _QUANTUM) * _QUANTUM
        adverse = np.flatnonzero(contributions > 0)
        # Largest contribution first; equal ones in code order.
        ranked = adverse[np.lexsort((self._code_rank[adverse], -contributions[adverse]))]
        return tuple(
            Reason(
                self.codes[i].code,
                self.codes[i].text,
                self._features[i],
                float(contributions[i]),
            )
            for i in ranked[:top_k]
        )


def _logit(scores: np.ndarray) -> np.ndarray:
    p = np.clip(scores.astype(np.float64), _EPS, 1.0 - _EPS)
    return np.log(p) - np.log1p(-p)


def log_codes(reasons: Sequence[Reason], top_k: int = LOGGED_CODES) -> list[str]:
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
    adverse-only mode) says nothing about which reason comes first. The shadow report computes
    the same figure in SQL over the log.
    """
    if len(champion) != len(challenger):
        raise ValueError(f"{len(champion)} champion records, {len(challenger)} challenger")
    pairs = differing = 0
    for ours, theirs in zip(champion, challenger, strict=True):
        if ours and theirs:
            pairs += 1
            differing += ours[0] != theirs[0]
    return TopReasonComparison(pairs, differing)
