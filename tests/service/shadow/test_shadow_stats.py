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

from service.shadow.report import stats

D_CHAMPION, D_CHALLENGER = 1.0, 1.4
TRUE_AUC = sps.norm.cdf(D_CHAMPION / math.sqrt(2))
TRUE_DIFFERENCE = sps.norm.cdf(D_CHALLENGER / math.sqrt(2)) - TRUE_AUC


def sample(rng: np.random.Generator, entities: int, repeats: int) -> tuple[np.ndarray, ...]:
    labels = (rng.random(entities) < 0.3).astype(np.int8)
    champion = rng.normal(size=entities) + D_CHAMPION * labels
    challenger = rng.normal(size=entities) + D_CHALLENGER * labels
    unit = np.arange(entities, dtype=np.uint64)
    return tuple(np.repeat(a, repeats) for a in (champion, challenger, labels, unit))


def analytic(champion, challenger, labels, keys) -> tuple[stats.Interval, stats.Interval]:
    clusters = stats.Clusters(keys)
    a, influence_a = stats.auc_influence(champion, labels, clusters)
    b, influence_b = stats.auc_influence(challenger, labels, clusters)
    return (
        stats.normal_interval(a, stats.robust_variance(influence_a)),
        stats.normal_interval(b - a, stats.robust_variance(influence_b - influence_a)),
    )


def covers(interval: stats.Interval, truth: float) -> bool:
    return interval.low <= truth <= interval.high


def test_auc_and_influence_match_sklearn_with_ties() -> None:
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 20, size=3000) / 20.0  # many ties
    labels = (rng.random(3000) < scores * 0.6).astype(np.int8)
    clusters = stats.Clusters(np.arange(3000, dtype=np.uint64))
    area, influence = stats.auc_influence(scores, labels, clusters)
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
        request = np.arange(len(labels), dtype=np.uint64)
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
    for _ in range(replications):
        champion, _, labels, entity = sample(rng, entities, repeats)
        ranked = stats.Ranked(champion, labels)
        point = float(ranked.auc()[0])
        for unit, keys in (("entity", entity), ("request", np.arange(len(labels)))):

            def auc(weights: np.ndarray) -> tuple[np.ndarray]:
                return (ranked.auc(weights[:, ranked.order]),)

            (draws,) = stats.poisson_bootstrap(stats.Clusters(keys), 100, rng, auc)
            hits[unit] += covers(stats.percentile_interval(point, draws), TRUE_AUC)
    assert 0.86 <= hits["entity"] / replications <= 1.0, hits
    assert hits["request"] / replications < 0.6, hits


def test_ratio_influence_is_the_delta_method() -> None:
    rng = np.random.default_rng(5)
    flagged = (rng.random(5000) < 0.2).astype(float)
    hit = flagged * (rng.random(5000) < 0.4)
    clusters = stats.Clusters(np.arange(5000, dtype=np.uint64))
    precision, influence = stats.ratio_influence(hit, flagged, clusters)
    assert precision == pytest.approx(hit.sum() / flagged.sum())
    # Independent records: the variance of a proportion, p(1 - p) / n flagged.
    expected = precision * (1 - precision) / flagged.sum()
    assert stats.robust_variance(influence) == pytest.approx(expected, rel=1e-3)


def test_ks_and_psi_match_scipy_on_large_samples() -> None:
    rng = np.random.default_rng(9)
    a, b = np.sort(rng.normal(size=40_000)), np.sort(rng.normal(0.03, 1.1, size=30_000))
    expected = sps.ks_2samp(a, b, method="asymp")
    assert stats.ks_2samp(a, b) == pytest.approx((expected.statistic, expected.pvalue), abs=1e-12)
    assert stats.spearman(a[:30_000], b) == pytest.approx(
        sps.spearmanr(a[:30_000], b).statistic, abs=1e-12
    )
