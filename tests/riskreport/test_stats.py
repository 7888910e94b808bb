"""Intervals on simulated data with a known truth: the entity is the unit when records repeat.

Positives' scores are N(d, 1) and negatives' N(0, 1), so the true AUC is Phi(d / sqrt(2)).
Each entity is drawn once and scored `repeats` times with the same result (a card scored many
times a day), which adds records and no information.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps
from sklearn.metrics import roc_auc_score

from riskreport import stats

D_CHAMPION, D_CHALLENGER = 1.0, 1.4
TRUE_AUC = sps.norm.cdf(D_CHAMPION / math.sqrt(2))
TRUE_DIFFERENCE = sps.norm.cdf(D_CHALLENGER / math.sqrt(2)) - TRUE_AUC


def sample(rng: np.random.Generator, entities: int, repeats: int) -> tuple[np.ndarray, ...]:
    labels = (rng.random(entities) < 0.3).astype(np.int8)
    champion = rng.normal(size=entities) + D_CHAMPION * labels
    challenger = rng.normal(size=entities) + D_CHALLENGER * labels
    unit = np.arange(entities)
    return tuple(np.repeat(a, repeats) for a in (champion, challenger, labels, unit))


def analytic(champion, challenger, labels, codes) -> tuple[stats.Interval, stats.Interval]:
    first = stats.sorted_pass(champion, labels, codes)
    second = stats.sorted_pass(challenger, labels, codes)
    return (
        stats.normal_interval(first.auc, stats.robust_variance(first.influence())),
        stats.normal_interval(
            second.auc - first.auc,
            stats.robust_variance(second.influence() - first.influence()),
        ),
    )


def covers(interval: stats.Interval, truth: float) -> bool:
    return interval.low <= truth <= interval.high


def test_auc_and_influence_match_sklearn_with_ties() -> None:
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 20, size=3000) / 20.0  # many ties
    labels = (rng.random(3000) < scores * 0.6).astype(np.int8)
    ordered = stats.sorted_pass(scores, labels, np.arange(3000), batch_rows=97)
    area, influence = ordered.auc, ordered.influence()
    assert area == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert influence.sum() == pytest.approx(0.0, abs=1e-9)  # influences are centred
    # With one record per unit the variance is DeLong's (up to its n/(n-1) factors).
    pos, neg = scores[labels == 1], scores[labels == 0]
    v10 = ((pos[:, None] > neg).sum(1) + 0.5 * (pos[:, None] == neg).sum(1)) / len(neg)
    v01 = ((pos[:, None] > neg).sum(0) + 0.5 * (pos[:, None] == neg).sum(0)) / len(pos)
    delong = v10.var(ddof=1) / len(pos) + v01.var(ddof=1) / len(neg)
    assert stats.robust_variance(influence) == pytest.approx(delong, rel=2e-3)


def test_entity_intervals_cover_the_truth_when_records_repeat_50_times() -> None:
    rng = np.random.default_rng(2024)
    replications, entities, repeats = 200, 120, 50
    hits = {"entity": [0, 0], "request": [0, 0]}
    for _ in range(replications):
        champion, challenger, labels, entity = sample(rng, entities, repeats)
        request = np.arange(len(labels))
        for unit, keys in (("entity", entity), ("request", request)):
            auc, difference = analytic(champion, challenger, labels, keys)
            hits[unit][0] += covers(auc, TRUE_AUC)
            hits[unit][1] += covers(difference, TRUE_DIFFERENCE)
    entity_coverage = [h / replications for h in hits["entity"]]
    request_coverage = [h / replications for h in hits["request"]]
    # 95 % intervals: entity-level coverage is about right; record-level far too narrow.
    assert all(0.89 <= c <= 0.99 for c in entity_coverage), entity_coverage
    assert all(c < 0.5 for c in request_coverage), request_coverage


def test_poisson_bootstrap_over_entities_covers_the_truth() -> None:
    rng = np.random.default_rng(7)
    replications, entities, repeats = 80, 60, 10
    hits = {"entity": 0, "request": 0}
    for replication in range(replications):
        champion, _, labels, entity = sample(rng, entities, repeats)
        for unit, codes in (("entity", entity), ("request", np.arange(len(labels)))):
            ordered = stats.sorted_pass(champion, labels, codes, resamples=100, seed=replication)
            interval = stats.percentile_interval(ordered.auc, ordered.resampled_auc())
            hits[unit] += covers(interval, TRUE_AUC)
    assert 0.86 <= hits["entity"] / replications <= 1.0, hits
    assert hits["request"] / replications < 0.6, hits


def test_ratio_influence_is_the_delta_method() -> None:
    rng = np.random.default_rng(5)
    flagged = (rng.random(5000) < 0.2).astype(float)
    hit = flagged * (rng.random(5000) < 0.4)
    precision, influence = stats.ratio_influence(hit, flagged)  # one record per cluster
    assert precision == pytest.approx(hit.sum() / flagged.sum())
    # Independent records: the variance of a proportion, p(1 - p) / n flagged.
    expected = precision * (1 - precision) / flagged.sum()
    assert stats.robust_variance(influence) == pytest.approx(expected, rel=1e-3)


def test_poisson_weights_are_poisson_and_stable_per_cluster() -> None:
    weights = stats.poisson_weights(np.arange(100_000), 4, seed=3)
    assert weights.mean() == pytest.approx(1.0, abs=0.01)
    assert weights.var() == pytest.approx(1.0, abs=0.02)
    assert (weights == 0).mean() == pytest.approx(math.exp(-1), abs=0.005)
    again = stats.poisson_weights(np.array([7, 3, 7]), 4, seed=3)
    assert np.array_equal(again, weights[:, [7, 3, 7]])  # the same cluster, the same weight


def test_ks_and_psi_match_scipy_on_large_samples() -> None:
    rng = np.random.default_rng(9)
    a, b = np.sort(rng.normal(size=40_000)), np.sort(rng.normal(0.03, 1.1, size=30_000))
    expected = sps.ks_2samp(a, b, method="asymp")
    assert stats.ks_2samp(a, b) == pytest.approx((expected.statistic, expected.pvalue), abs=1e-12)
    assert stats.spearman(a[:30_000], b) == pytest.approx(
        sps.spearmanr(a[:30_000], b).statistic, abs=1e-12
    )
