"""Statistics of the report, on numpy arrays: correlation, drift, AUC and bootstrap intervals.

AUC, precision and recall are computed from per-sample weights, so a bootstrap resample is a
vector of multiplicities (how often each sample was drawn) and the scores are sorted once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

__all__ = [
    "PSI_BINS",
    "Interval",
    "auc",
    "bootstrap",
    "bootstrap_weights",
    "ks_2samp",
    "pearson",
    "psi",
    "roc_points",
    "spearman",
    "weighted_auc",
]

PSI_BINS = 10
PSI_FLOOR = 1e-4
MAX_WEIGHT_CELLS = 2_000_000


@dataclass(frozen=True, slots=True)
class Interval:
    """A point estimate with a two-sided 95% percentile-bootstrap interval (NaN when undefined)."""

    estimate: float
    low: float
    high: float


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2:
        return float("nan")
    xc, yc = x - x.mean(), y - y.mean()
    denominator = np.sqrt(np.dot(xc, xc) * np.dot(yc, yc))
    return float(np.dot(xc, yc) / denominator) if denominator > 0 else float("nan")


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(sps.rankdata(x), sps.rankdata(y))


def ks_2samp(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic and p-value (NaN when a sample is empty).

    The p-value is exact for small samples (n1 * n2 <= 10 000) and asymptotic above, where the
    exact computation is slow and can fail to converge.
    """
    if len(a) == 0 or len(b) == 0:
        return float("nan"), float("nan")
    method = "exact" if len(a) * len(b) <= 10_000 else "asymp"
    result = sps.ks_2samp(a, b, method=method)
    return float(result.statistic), float(result.pvalue)


def psi(expected: np.ndarray, actual: np.ndarray, bins: int = PSI_BINS) -> float:
    """Population stability index of `actual` against `expected`.

    Bins: `bins` quantile bins of `expected` (its deciles by default), duplicate edges merged,
    the outer bins open-ended; each bin's share is floored at `PSI_FLOOR` before the log.
    PSI = sum over bins of (actual share - expected share) * ln(actual share / expected share).
    """
    if len(expected) == 0 or len(actual) == 0:
        return float("nan")
    interior = np.unique(np.quantile(expected, np.linspace(0, 1, bins + 1)[1:-1]))
    e = np.bincount(np.searchsorted(interior, expected, side="right"), minlength=len(interior) + 1)
    a = np.bincount(np.searchsorted(interior, actual, side="right"), minlength=len(interior) + 1)
    e_share = np.maximum(e / e.sum(), PSI_FLOOR)
    a_share = np.maximum(a / a.sum(), PSI_FLOOR)
    return float(np.sum((a_share - e_share) * np.log(a_share / e_share)))


class _Ranked:
    """Scores sorted once and grouped by tied value, with each sample's group index."""

    def __init__(self, scores: np.ndarray, labels: np.ndarray) -> None:
        self.order = np.argsort(scores, kind="stable")
        sorted_scores = scores[self.order]
        self.starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
        self.positive = labels[self.order].astype(np.float64)


def weighted_auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUC per row of `weights` (shape (k, n)); ties count one half; NaN if a class is empty."""
    ranked = _Ranked(scores, labels)
    w = weights[:, ranked.order]
    pos = np.add.reduceat(w * ranked.positive, ranked.starts, axis=1)
    neg = np.add.reduceat(w * (1.0 - ranked.positive), ranked.starts, axis=1)
    below = np.cumsum(neg, axis=1) - neg
    total_pos, total_neg = pos.sum(axis=1), neg.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        result = (pos * (below + 0.5 * neg)).sum(axis=1) / (total_pos * total_neg)
    return np.where((total_pos > 0) & (total_neg > 0), result, np.nan)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    if len(scores) == 0:
        return float("nan")
    return float(weighted_auc(scores, labels, np.ones((1, len(scores))))[0])


def weighted_precision_recall(
    predicted: np.ndarray, labels: np.ndarray, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Precision and recall of boolean predictions for each row of `weights`."""
    hit = (predicted & (labels == 1)).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = (weights @ hit) / (weights @ predicted.astype(np.float64))
        recall = (weights @ hit) / (weights @ (labels == 1).astype(np.float64))
    return precision, recall


def bootstrap_weights(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Multiplicities of `resamples` bootstrap draws of n out of n, shape (resamples, n)."""
    draws = rng.integers(0, n, size=(resamples, n))
    flat = draws + (np.arange(resamples) * n)[:, None]
    return np.bincount(flat.ravel(), minlength=resamples * n).reshape(resamples, n).astype(float)


def bootstrap(
    n: int,
    resamples: int,
    rng: np.random.Generator,
    statistic: Callable[[np.ndarray], tuple[np.ndarray, ...]],
    max_cells: int = MAX_WEIGHT_CELLS,
) -> tuple[np.ndarray, ...]:
    """Apply `statistic` to bootstrap weight matrices, in chunks that bound memory use.

    `statistic(weights)` returns arrays of one value per weights row; the chunks' results are
    concatenated, so the caller sees one array of `resamples` values per returned array.
    """
    chunk = max(1, max_cells // max(n, 1))
    parts: list[tuple[np.ndarray, ...]] = []
    for done in range(0, resamples, chunk):
        parts.append(statistic(bootstrap_weights(n, min(chunk, resamples - done), rng)))
    if not parts:
        return ()
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))


def interval(estimate: float, resampled: np.ndarray) -> Interval:
    finite = resampled[np.isfinite(resampled)]
    if len(finite) == 0 or not np.isfinite(estimate):
        return Interval(float(estimate), float("nan"), float("nan"))
    low, high = np.percentile(finite, [2.5, 97.5])
    return Interval(float(estimate), float(low), float(high))


def roc_points(
    scores: np.ndarray, labels: np.ndarray, max_points: int = 200
) -> tuple[tuple[float, float], ...]:
    """(false positive rate, true positive rate) from the highest threshold down, thinned."""
    ranked = _Ranked(-scores, labels)
    pos = np.add.reduceat(ranked.positive, ranked.starts)
    neg = np.add.reduceat(1.0 - ranked.positive, ranked.starts)
    if pos.sum() == 0 or neg.sum() == 0:
        return ()
    tpr = np.r_[0.0, np.cumsum(pos) / pos.sum()]
    fpr = np.r_[0.0, np.cumsum(neg) / neg.sum()]
    keep = np.unique(np.linspace(0, len(tpr) - 1, min(max_points, len(tpr))).round().astype(int))
    return tuple((float(fpr[i]), float(tpr[i])) for i in keep)
