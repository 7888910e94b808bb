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
    "Interval",
    "OrderedBatch",
    "SortedPass",
    "ks_2samp",
    "normal_interval",
    "pearson",
    "percentile_interval",
    "poisson_weights",
    "psi",
    "ratio_influence",
    "resampled_ratio",
    "robust_variance",
    "sorted_pass",
    "spearman",
]

PSI_BINS = 10
PSI_FLOOR = 1e-4
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


# --- AUC: one pass in ascending score order ------------------------------------------------


@dataclass(frozen=True, slots=True)
class OrderedBatch:
    """Rows in ascending score order: label 1/0 (-1: unlabelled), cluster code, row id."""

    scores: np.ndarray
    labels: np.ndarray
    codes: np.ndarray
    ids: np.ndarray | None = None
    decisions: np.ndarray | None = None
    """0 approve, 1 review, 2 decline: counted per cluster for precision and recall."""


class SortedPass:
    """AUC, DeLong placements per cluster, average ranks and ROC points in one ordered pass.

    Feed batches in ascending score order (a tie group may span batches: its rows are held
    back until the group ends), then call `finish`. Memory: a few arrays per cluster and per
    batch, whatever the number of rows. With `resamples`, the weighted AUC of every Poisson
    resample over clusters accumulates in the same pass. `rows` (the total to come) places
    the ROC points and centres the ranks handed to `rank_sink(ids, twice_average_rank)`.
    """

    def __init__(
        self,
        clusters: int,
        *,
        resamples: int = 0,
        seed: int = 0,
        rank_sink: Callable[[np.ndarray, np.ndarray], None] | None = None,
        rows: int = 0,
        roc_points: int = 200,
    ) -> None:
        self.k = clusters
        self.m = self.n = 0  # positives and negatives seen
        # Per cluster: negatives below each positive (ties half) and positives at or below
        # each negative (ties half), summed; divided by n and turned into placements at the end.
        self._neg_below = np.zeros(clusters)
        self._pos_at_or_below = np.zeros(clusters)
        self.pos_per_cluster = np.zeros(clusters)
        self.neg_per_cluster = np.zeros(clusters)
        self.flagged = {level: np.zeros(clusters) for level in (1, 2)}
        self.hits = {level: np.zeros(clusters) for level in (1, 2)}
        self._area = 0.0
        self._rows_before = 0
        self._carry: OrderedBatch | None = None
        self.resamples, self.seed = resamples, seed
        self._w_area = np.zeros(resamples)
        self._w_neg_before = np.zeros(resamples)
        self._w_pos = np.zeros(resamples)
        self._rank_sink = rank_sink
        self._rows_total = rows
        self._roc_step = max(1, rows // roc_points) if rows else 0
        self._roc: list[tuple[int, int]] = []
        self.rank_sum_sq = 0.0
        """Sum over rows of (average rank - mean rank)^2, when ranks are handed out."""

    def add(self, batch: OrderedBatch) -> None:
        if self._carry is not None:
            batch = _concat(self._carry, batch)
        if len(batch.scores) == 0:
            return
        cut = int(np.searchsorted(batch.scores, batch.scores[-1], side="left"))
        self._carry = _take(batch, slice(cut, None))
        if cut:
            self._process(_take(batch, slice(0, cut)))

    def finish(self) -> SortedPass:
        if self._carry is not None and len(self._carry.scores):
            self._process(self._carry)
        self._carry = None
        return self

    @property
    def auc(self) -> float:
        if self.m == 0 or self.n == 0:
            return math.nan
        return self._area / (self.m * self.n)

    def influence(self) -> np.ndarray:
        """Each cluster's influence on the AUC; the variance is their robust sum of squares.

        Cluster k's influence is (sum of its positives' placements - m_k A) / m + (sum of its
        negatives' placements - n_k A) / n, where a positive's placement is the share of
        negatives below it and a negative's the share of positives above it (ties half).
        """
        area = self.auc
        if not math.isfinite(area):
            return np.zeros(self.k)
        placement_pos = self._neg_below / self.n
        placement_neg = (self.neg_per_cluster * self.m - self._pos_at_or_below) / self.m
        return (placement_pos - self.pos_per_cluster * area) / self.m + (
            placement_neg - self.neg_per_cluster * area
        ) / self.n

    def resampled_auc(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            result = self._w_area / (self._w_pos * self._w_neg_before)
        return np.where((self._w_pos > 0) & (self._w_neg_before > 0), result, np.nan)

    def roc(self) -> tuple[tuple[float, float], ...]:
        """(false positive rate, true positive rate) from the highest threshold down."""
        if self.m == 0 or self.n == 0:
            return ()
        points = {((self.n - neg) / self.n, (self.m - pos) / self.m) for pos, neg in self._roc}
        points |= {(0.0, 0.0), (1.0, 1.0)}
        return tuple(sorted(points))

    def _process(self, batch: OrderedBatch) -> None:
        scores, labels, codes = batch.scores, batch.labels, batch.codes
        positive, negative = labels == 1, labels == 0
        first = np.empty(len(scores), dtype=bool)
        first[0] = True
        np.not_equal(scores[1:], scores[:-1], out=first[1:])
        if first.all():  # no ties, the usual case with continuous scores: a group is a row
            pos_g, neg_g = positive.astype(np.int64), negative.astype(np.int64)
            ends = self._rows_before + np.arange(1, len(scores) + 1)
            sizes: np.ndarray | None = None

            def per_row(values: np.ndarray) -> np.ndarray:
                return values
        else:
            starts = np.flatnonzero(first)
            pos_g = np.add.reduceat(positive, starts, dtype=np.int64)
            neg_g = np.add.reduceat(negative, starts, dtype=np.int64)
            sizes = np.diff(np.r_[starts, len(scores)])
            ends = self._rows_before + np.cumsum(sizes)
            group = np.cumsum(first) - 1

            def per_row(values: np.ndarray) -> np.ndarray:
                return values[group]

        pos_le, neg_le = self.m + np.cumsum(pos_g), self.n + np.cumsum(neg_g)
        neg_below_half = neg_le - 0.5 * neg_g
        self._area += float(np.dot(pos_g, neg_below_half))
        # np.add.at, not bincount: no array of every cluster per batch (millions of entities).
        pos_codes, neg_codes = codes[positive], codes[negative]
        np.add.at(self._neg_below, pos_codes, per_row(neg_below_half)[positive])
        np.add.at(self._pos_at_or_below, neg_codes, per_row(pos_le - 0.5 * pos_g)[negative])
        np.add.at(self.pos_per_cluster, pos_codes, 1.0)
        np.add.at(self.neg_per_cluster, neg_codes, 1.0)
        if batch.decisions is not None:
            labelled = positive | negative  # a flagged record with no label is no miss
            for level in (1, 2):
                flagged = (batch.decisions >= level) & labelled
                np.add.at(self.flagged[level], codes[flagged], 1.0)
                np.add.at(self.hits[level], codes[flagged & positive], 1.0)
        if self.resamples:
            self._weighted(batch, first, positive, negative)
        if self._rank_sink is not None:
            # A tie group ending at row e with s rows shares the mean rank e - (s - 1) / 2.
            twice_rank = per_row(2 * ends + 1 - (1 if sizes is None else sizes))
            centred = twice_rank / 2 - (self._rows_total + 1) / 2
            self.rank_sum_sq += float(np.dot(centred, centred))
            if batch.ids is not None:
                self._rank_sink(batch.ids, twice_rank)
        if self._roc_step:
            marks = ends // self._roc_step
            keep = np.flatnonzero(np.r_[marks[1:] != marks[:-1], True])
            self._roc += list(zip(pos_le[keep].tolist(), neg_le[keep].tolist(), strict=True))
        self.m, self.n = int(pos_le[-1]), int(neg_le[-1])
        self._rows_before += len(scores)

    def _weighted(
        self, batch: OrderedBatch, first: np.ndarray, positive: np.ndarray, negative: np.ndarray
    ) -> None:
        starts = np.flatnonzero(first)
        w = poisson_weights(batch.codes, self.resamples, self.seed)
        pos_w = np.add.reduceat(w * positive, starts, axis=1)
        neg_w = np.add.reduceat(w * negative, starts, axis=1)
        below = self._w_neg_before[:, None] + np.cumsum(neg_w, axis=1) - neg_w
        self._w_area += (pos_w * (below + 0.5 * neg_w)).sum(axis=1)
        self._w_neg_before += neg_w.sum(axis=1)
        self._w_pos += pos_w.sum(axis=1)


def _take(batch: OrderedBatch, rows: slice) -> OrderedBatch:
    ids = None if batch.ids is None else batch.ids[rows]
    decisions = None if batch.decisions is None else batch.decisions[rows]
    return OrderedBatch(batch.scores[rows], batch.labels[rows], batch.codes[rows], ids, decisions)


def _concat(first: OrderedBatch, second: OrderedBatch) -> OrderedBatch:
    def both(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
        return None if a is None or b is None else np.r_[a, b]

    return OrderedBatch(
        np.r_[first.scores, second.scores],
        np.r_[first.labels, second.labels],
        np.r_[first.codes, second.codes],
        both(first.ids, second.ids),
        both(first.decisions, second.decisions),
    )


def sorted_pass(
    scores: np.ndarray,
    labels: np.ndarray,
    codes: np.ndarray,
    *,
    resamples: int = 0,
    seed: int = 0,
    batch_rows: int = 100_000,
) -> SortedPass:
    """`SortedPass` over in-memory arrays (sorted here), in batches as the report feeds it."""
    order = np.argsort(scores, kind="stable")
    clusters = int(codes.max()) + 1 if len(codes) else 0
    result = SortedPass(clusters, resamples=resamples, seed=seed, rows=len(scores))
    for start in range(0, len(order), batch_rows):
        rows = order[start : start + batch_rows]
        result.add(OrderedBatch(scores[rows], labels[rows], codes[rows]))
    return result.finish()


def ratio_influence(numerator: np.ndarray, denominator: np.ndarray) -> tuple[float, np.ndarray]:
    """A ratio of sums (precision, recall) from per-cluster sums, and each cluster's
    influence on it (the delta method)."""
    total = float(denominator.sum())
    if total == 0:
        return math.nan, np.zeros(len(numerator))
    ratio = float(numerator.sum()) / total
    return ratio, (numerator - ratio * denominator) / total


_POISSON_CDF = np.cumsum([math.exp(-1) / math.factorial(k) for k in range(20)])


def poisson_weights(codes: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """Poisson(1) weights, shape (resamples, len(codes)): a bootstrap over clusters.

    Each (seed, resample, cluster) draws its weight from a counter-based hash (splitmix64),
    so the rows of one cluster get the same weight in every batch and every pass, with no
    table of resamples x clusters in memory.
    """
    counter = (
        codes.astype(np.uint64)[None, :] * np.uint64(resamples)
        + np.arange(resamples, dtype=np.uint64)[:, None]
        + np.uint64((seed * 0x9E3779B97F4A7C15) % 2**64)
    )
    z = counter + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    uniform = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return np.searchsorted(_POISSON_CDF, uniform, side="right").astype(np.float64)


def resampled_ratio(
    numerator: np.ndarray, denominator: np.ndarray, resamples: int, seed: int
) -> np.ndarray:
    """A ratio of per-cluster sums under each resample's cluster weights."""
    top, bottom = np.zeros(resamples), np.zeros(resamples)
    block = max(1, 4_000_000 // max(resamples, 1))
    for start in range(0, len(numerator), block):
        codes = np.arange(start, min(start + block, len(numerator)))
        weights = poisson_weights(codes, resamples, seed)
        top += weights @ numerator[codes]
        bottom += weights @ denominator[codes]
    with np.errstate(invalid="ignore", divide="ignore"):
        return top / bottom
