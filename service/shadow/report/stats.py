"""Statistics of the report, on numpy arrays sorted once.

Intervals treat the entity (a card, a customer) as the unit: records of one entity are
correlated, so they form one cluster. Two ways, both sorting the scores once:

- analytic (the default): DeLong's placement values for AUC, summed per entity
  (Obuchowski's clustered form), and the delta method for precision and recall; each figure's
  variance is the cluster-robust sum of squared per-entity influences.
- a Poisson bootstrap over entities: each entity gets a Poisson(1) weight per resample, so a
  resample is a weight vector over the already sorted records and never sorts again.

With the record as the unit (each record its own cluster) both reduce to the usual formulas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

__all__ = [
    "PSI_BINS",
    "Clusters",
    "Interval",
    "auc_influence",
    "ks_2samp",
    "pearson",
    "poisson_bootstrap",
    "psi",
    "ratio_influence",
    "roc_points",
    "spearman",
    "weighted_auc",
]

PSI_BINS = 10
PSI_FLOOR = 1e-4
MAX_WEIGHT_CELLS = 4_000_000
Z_95 = 1.959963984540054


@dataclass(frozen=True, slots=True)
class Interval:
    """A point estimate with a two-sided 95% interval (NaN when undefined)."""

    estimate: float
    low: float
    high: float


def normal_interval(estimate: float, variance: float) -> Interval:
    if not (math.isfinite(estimate) and math.isfinite(variance)) or variance < 0:
        return Interval(float(estimate), math.nan, math.nan)
    half = Z_95 * math.sqrt(variance)
    return Interval(float(estimate), estimate - half, estimate + half)


def percentile_interval(estimate: float, resampled: np.ndarray) -> Interval:
    finite = resampled[np.isfinite(resampled)]
    if len(finite) == 0 or not math.isfinite(estimate):
        return Interval(float(estimate), math.nan, math.nan)
    low, high = np.percentile(finite, [2.5, 97.5])
    return Interval(float(estimate), float(low), float(high))


class Clusters:
    """Each record's cluster (entity) as a code 0..count-1, from 64-bit entity keys."""

    def __init__(self, keys: np.ndarray) -> None:
        self.keys, self.codes = np.unique(keys, return_inverse=True)
        self.codes = self.codes.astype(np.int64, copy=False)

    @property
    def count(self) -> int:
        return len(self.keys)

    def sums(self, values: np.ndarray) -> np.ndarray:
        return np.bincount(self.codes, weights=values, minlength=self.count)


def robust_variance(influence: np.ndarray) -> float:
    """Cluster-robust variance from per-cluster influences (each already divided by n)."""
    k = len(influence)
    if k < 2:
        return math.nan
    return float(k / (k - 1) * np.dot(influence, influence))


# --- correlation and drift --------------------------------------------------------------------


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2:
        return math.nan
    xc, yc = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float(np.dot(xc, xc)) * float(np.dot(yc, yc)))
    return float(np.dot(xc, yc) / denominator) if denominator > 0 else math.nan


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties sharing their mean rank (as scipy's rankdata)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    del ordered
    ends = np.r_[starts[1:], len(values)]
    mean_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2:
        return math.nan
    return pearson(average_ranks(x), average_ranks(y))


def ks_2samp(a_sorted: np.ndarray, b_sorted: np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic and two-sided p-value, on sorted samples.

    The statistic is exact; the p-value is scipy's exact one for small samples
    (n1 * n2 <= 10 000) and Smirnov's asymptotic distribution above, as scipy computes it.
    """
    n1, n2 = len(a_sorted), len(b_sorted)
    if n1 == 0 or n2 == 0:
        return math.nan, math.nan
    if n1 * n2 <= 10_000:
        result = sps.ks_2samp(a_sorted, b_sorted, method="exact")
        return float(result.statistic), float(result.pvalue)
    d = 0.0
    for points in (a_sorted, b_sorted):
        for start in range(0, len(points), 4_000_000):  # bounded temporaries
            chunk = points[start : start + 4_000_000]
            cdf_a = np.searchsorted(a_sorted, chunk, side="right") / n1
            cdf_b = np.searchsorted(b_sorted, chunk, side="right") / n2
            d = max(d, float(np.max(np.abs(cdf_a - cdf_b))))
    m, n = sorted((float(n1), float(n2)), reverse=True)
    p = float(np.clip(sps.kstwo.sf(d, np.round(m * n / (m + n))), 0, 1))
    return d, p


def quantiles_of_sorted(values: np.ndarray, q: np.ndarray) -> np.ndarray:
    """numpy's default (linear) quantiles of an already sorted array, without sorting it."""
    position = q * (len(values) - 1)
    low = np.floor(position).astype(np.int64)
    high = np.minimum(low + 1, len(values) - 1)
    fraction = position - low
    return values[low] + fraction * (values[high] - values[low])


def psi(expected_sorted: np.ndarray, actual_sorted: np.ndarray, bins: int = PSI_BINS) -> float:
    """Population stability index of `actual` against `expected` (both sorted ascending).

    Bins: `bins` quantile bins of `expected` (its deciles by default), duplicate edges merged,
    the outer bins open-ended; each bin's share is floored at `PSI_FLOOR` before the log.
    PSI = sum over bins of (actual share - expected share) * ln(actual share / expected share).
    """
    if len(expected_sorted) == 0 or len(actual_sorted) == 0:
        return math.nan
    interior = np.unique(quantiles_of_sorted(expected_sorted, np.linspace(0, 1, bins + 1)[1:-1]))

    def shares(values: np.ndarray) -> np.ndarray:
        cuts = np.r_[0, np.searchsorted(values, interior, side="left"), len(values)]
        return np.maximum(np.diff(cuts) / len(values), PSI_FLOOR)

    e, a = shares(expected_sorted), shares(actual_sorted)
    return float(np.sum((a - e) * np.log(a / e)))


# --- AUC --------------------------------------------------------------------------------------


class Ranked:
    """Scores sorted once and grouped by tied value; reused by every figure and resample."""

    def __init__(self, scores: np.ndarray, positive: np.ndarray) -> None:
        self.order = np.argsort(scores, kind="stable")
        ordered = scores[self.order]
        self.starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        self.group = np.repeat(np.arange(len(self.starts)), np.diff(np.r_[self.starts, len(ordered)]))
        self.positive = positive[self.order].astype(np.float64)

    def auc(self, weights: np.ndarray | None = None) -> np.ndarray:
        """AUC per row of `weights` (k, n) given in sorted order; ties count one half."""
        w = np.ones((1, len(self.positive))) if weights is None else weights
        pos = np.add.reduceat(w * self.positive, self.starts, axis=1)
        neg = np.add.reduceat(w * (1.0 - self.positive), self.starts, axis=1)
        below = np.cumsum(neg, axis=1) - neg
        total_pos, total_neg = pos.sum(axis=1), neg.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            result = (pos * (below + 0.5 * neg)).sum(axis=1) / (total_pos * total_neg)
        return np.where((total_pos > 0) & (total_neg > 0), result, np.nan)


def weighted_auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUC per row of `weights` (shape (k, n), in the records' order)."""
    ranked = Ranked(scores, labels)
    return ranked.auc(weights[:, ranked.order])


def auc_influence(
    scores: np.ndarray, labels: np.ndarray, clusters: Clusters, ranked: Ranked | None = None
) -> tuple[float, np.ndarray]:
    """AUC and each cluster's influence on it (DeLong placements summed per cluster).

    With m positives, n negatives and A the AUC, cluster k's influence is
    (sum of its positives' placements - m_k A) / m + (sum of its negatives' - n_k A) / n;
    the AUC's variance is the cluster-robust sum of their squares.
    """
    positive = labels == 1
    m, n = int(positive.sum()), int(len(labels) - positive.sum())
    if m == 0 or n == 0:
        return math.nan, np.zeros(clusters.count)
    ranked = ranked or Ranked(scores, labels)
    pos_sorted = ranked.positive
    pos_group = np.add.reduceat(pos_sorted, ranked.starts)
    neg_group = np.add.reduceat(1.0 - pos_sorted, ranked.starts)
    neg_below = np.cumsum(neg_group) - neg_group
    pos_above = m - np.cumsum(pos_group)
    # Placement of a positive: share of negatives below it (ties half); of a negative: share
    # of positives above it (ties half).
    v10 = ((neg_below + 0.5 * neg_group) / n)[ranked.group]
    v01 = ((pos_above + 0.5 * pos_group) / m)[ranked.group]
    placement = np.where(pos_sorted == 1.0, v10, v01)
    del v10, v01
    area = float(np.dot(pos_group, neg_below + 0.5 * neg_group) / (m * n))
    placement_rows = np.empty_like(placement)
    placement_rows[ranked.order] = placement
    del placement
    pos_f = positive.astype(np.float64)
    influence = clusters.sums(placement_rows * pos_f) / m - clusters.sums(pos_f) * area / m
    influence += clusters.sums(placement_rows * (1.0 - pos_f)) / n
    influence -= clusters.sums(1.0 - pos_f) * area / n
    return area, influence


def ratio_influence(
    numerator: np.ndarray, denominator: np.ndarray, clusters: Clusters
) -> tuple[float, np.ndarray]:
    """A ratio of sums (precision, recall) and each cluster's influence (delta method)."""
    total = float(denominator.sum())
    if total == 0:
        return math.nan, np.zeros(clusters.count)
    ratio = float(numerator.sum()) / total
    return ratio, (clusters.sums(numerator) - ratio * clusters.sums(denominator)) / total


def poisson_bootstrap(
    clusters: Clusters,
    resamples: int,
    rng: np.random.Generator,
    statistic: Callable[[np.ndarray], tuple[np.ndarray, ...]],
    max_cells: int = MAX_WEIGHT_CELLS,
) -> tuple[np.ndarray, ...]:
    """Apply `statistic` to per-record weight matrices, a Poisson(1) weight per cluster.

    `statistic(weights)` gets weights of shape (k, records) and returns arrays of k values;
    resamples run in chunks that bound memory, and the results are concatenated.
    """
    records = len(clusters.codes)
    chunk = max(1, max_cells // max(records, 1))
    parts: list[tuple[np.ndarray, ...]] = []
    for done in range(0, resamples, chunk):
        size = min(chunk, resamples - done)
        per_cluster = rng.poisson(1.0, size=(size, clusters.count)).astype(np.float64)
        parts.append(statistic(per_cluster[:, clusters.codes]))
    if not parts:
        return ()
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))


def roc_points(ranked: Ranked, max_points: int = 200) -> tuple[tuple[float, float], ...]:
    """(false positive rate, true positive rate) from the highest threshold down, thinned."""
    pos = np.add.reduceat(ranked.positive, ranked.starts)[::-1]
    neg = np.add.reduceat(1.0 - ranked.positive, ranked.starts)[::-1]
    if pos.sum() == 0 or neg.sum() == 0:
        return ()
    tpr = np.r_[0.0, np.cumsum(pos) / pos.sum()]
    fpr = np.r_[0.0, np.cumsum(neg) / neg.sum()]
    keep = np.unique(np.linspace(0, len(tpr) - 1, min(max_points, len(tpr))).round().astype(int))
    return tuple((float(fpr[i]), float(tpr[i])) for i in keep)
