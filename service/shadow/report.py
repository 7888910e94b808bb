"""`build_report`: compare an experiment's arms from its logged records (and labels, if any)."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from engines.manifest import Thresholds
from service.shadow import stats
from service.shadow.dataset import read_records
from service.shadow.labels import UNLABELLED, read_labels
from service.shadow.stats import Interval

__all__ = [
    "DECISIONS",
    "ArmSummary",
    "Comparison",
    "Histogram",
    "LabelMetrics",
    "Report",
    "build_report",
]

DECISIONS = ("APPROVE", "REVIEW", "DECLINE")
DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 20240601


@dataclass(frozen=True, slots=True)
class Histogram:
    edges: tuple[float, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LabelMetrics:
    """Quality against labels; "at review" means flagged = REVIEW or DECLINE."""

    labelled: int
    positives: int
    auc: Interval
    precision_at_review: Interval
    recall_at_review: Interval
    precision_at_decline: Interval
    recall_at_decline: Interval
    roc: tuple[tuple[float, float], ...]


@dataclass(frozen=True, slots=True)
class ArmSummary:
    arm: str
    version: str
    records: int
    served: int
    engines: dict[str, int]
    decisions: dict[str, int]
    score_mean: float
    latency_ms_p50: float
    latency_ms_p99: float
    score_histogram: Histogram
    latency_histogram: Histogram
    labels: LabelMetrics | None


@dataclass(frozen=True, slots=True)
class Comparison:
    """One challenger version against the champion; paired figures use shared request_ids."""

    challenger_version: str
    pairs: int
    decision_agreement: float
    confusion: dict[str, dict[str, int]]
    """champion decision -> challenger decision -> count, over the pairs."""
    pearson: float
    spearman: float
    mean_abs_diff: float
    max_abs_diff: float
    psi: float
    ks_statistic: float
    ks_pvalue: float
    auc_difference: Interval | None
    """Challenger AUC minus champion AUC."""
    auc_difference_method: str | None
    verdict: str


@dataclass(frozen=True, slots=True)
class Report:
    experiment: str
    model: str
    modes: tuple[str, ...]
    start: str | None
    end: str | None
    generated_at: str
    records: int
    replicas: tuple[str, ...]
    thresholds: dict[str, float] | None
    """Review/decline cut-offs used; None means the logged decisions were used."""
    bootstrap_resamples: int
    seed: int
    psi_bins: int
    arms: tuple[ArmSummary, ...]
    comparisons: tuple[Comparison, ...]

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


def _finite(value: Any) -> Any:
    """NaN/inf become null so the JSON is standard."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class _Arm:
    """Arrays of one (arm, version) slice of the records."""

    arm: str
    version: str
    rows: np.ndarray
    scores: np.ndarray
    decisions: np.ndarray
    latency_ms: np.ndarray
    labels: np.ndarray


def build_report(
    prefix: str,
    start: datetime | None = None,
    end: datetime | None = None,
    labels_path: str | None = None,
    thresholds: Thresholds | None = None,
    *,
    experiment: str | None = None,
    filesystem: pafs.FileSystem | None = None,
    bootstrap_resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> Report:
    """Read all replicas' records under `prefix` and compare champion and challengers.

    With `thresholds` the decisions are recomputed from the scores (e.g. the manifest's);
    without, the logged decisions are used. Raises `NoRecords` when nothing matches.
    """
    table = read_records(prefix, experiment=experiment, start=start, end=end, filesystem=filesystem)
    labels = read_labels(labels_path).lookup(table) if labels_path else None
    arms = _split_arms(table, thresholds, labels)
    champions = [a for a in arms if a.arm == "champion"]
    rng = np.random.default_rng(seed)
    summaries = tuple(
        _summarize(a, table, labels is not None, bootstrap_resamples, rng) for a in arms
    )
    request_ids = np.array(table.column("request_id").to_pylist(), dtype=object)
    comparisons = tuple(
        _compare(_merge(champions), a, request_ids, labels is not None, bootstrap_resamples, rng)
        for a in arms
        if a.arm == "challenger" and champions
    )
    return Report(
        experiment=table.column("experiment")[0].as_py(),
        model=table.column("model")[0].as_py(),
        modes=tuple(sorted(set(table.column("mode").to_pylist()))),
        start=start.isoformat() if start else None,
        end=end.isoformat() if end else None,
        generated_at=datetime.now(UTC).isoformat(),
        records=table.num_rows,
        replicas=tuple(sorted(set(table.column("replica_id").to_pylist()))),
        thresholds=None
        if thresholds is None
        else {"review": thresholds.review, "decline": thresholds.decline},
        bootstrap_resamples=bootstrap_resamples,
        seed=seed,
        psi_bins=stats.PSI_BINS,
        arms=summaries,
        comparisons=comparisons,
    )


def _split_arms(
    table: pa.Table, thresholds: Thresholds | None, labels: np.ndarray | None
) -> list[_Arm]:
    scores = table.column("score").to_numpy()
    if thresholds is None:
        decisions = np.array(table.column("decision").to_pylist(), dtype=object)
    else:
        decisions = np.where(
            scores >= thresholds.decline,
            "DECLINE",
            np.where(scores >= thresholds.review, "REVIEW", "APPROVE"),
        )
        decisions = decisions.astype(object)
    latency = table.column("latency_ms").to_numpy()
    label_array = labels if labels is not None else np.full(len(scores), UNLABELLED, np.int8)
    arm_col = np.array(table.column("arm").to_pylist(), dtype=object)
    version_col = np.array(table.column("version").to_pylist(), dtype=object)
    keys = sorted(
        set(zip(arm_col.tolist(), version_col.tolist(), strict=True)),
        key=lambda k: (k[0] != "champion", k[1]),
    )
    result = []
    for arm, version in keys:
        rows = np.flatnonzero((arm_col == arm) & (version_col == version))
        result.append(
            _Arm(
                arm, version, rows, scores[rows], decisions[rows], latency[rows], label_array[rows]
            )
        )
    return result


def _merge(arms: list[_Arm]) -> _Arm:
    """All champion versions as one baseline (the champion may change inside a window)."""
    if len(arms) == 1:
        return arms[0]
    cat = np.concatenate
    return _Arm(
        "champion",
        "+".join(a.version for a in arms),
        cat([a.rows for a in arms]),
        cat([a.scores for a in arms]),
        cat([a.decisions for a in arms]),
        cat([a.latency_ms for a in arms]),
        cat([a.labels for a in arms]),
    )


def _summarize(
    arm: _Arm, table: pa.Table, with_labels: bool, resamples: int, rng: np.random.Generator
) -> ArmSummary:
    engines = Counter(table.column("engine").take(pa.array(arm.rows)).to_pylist())
    served = int(np.sum(table.column("served").take(pa.array(arm.rows)).to_numpy()))
    p50, p99 = np.percentile(arm.latency_ms, [50, 99])
    return ArmSummary(
        arm=arm.arm,
        version=arm.version,
        records=len(arm.rows),
        served=served,
        engines=dict(sorted(engines.items())),
        decisions={d: int(np.sum(arm.decisions == d)) for d in DECISIONS},
        score_mean=float(arm.scores.mean()),
        latency_ms_p50=float(p50),
        latency_ms_p99=float(p99),
        score_histogram=_histogram(arm.scores, _score_edges(arm.scores)),
        latency_histogram=_histogram(arm.latency_ms, _latency_edges(arm.latency_ms)),
        labels=_label_metrics(arm, resamples, rng) if with_labels else None,
    )


def _score_edges(scores: np.ndarray) -> np.ndarray:
    low, high = min(0.0, float(scores.min())), max(1.0, float(scores.max()))
    return np.linspace(low, high, 41)


def _latency_edges(latency_ms: np.ndarray) -> np.ndarray:
    positive = latency_ms[latency_ms > 0]
    low = float(positive.min()) if len(positive) else 1e-3
    high = max(float(latency_ms.max()), low * 1.01)
    return np.geomspace(low, high, 41)


def _histogram(values: np.ndarray, edges: np.ndarray) -> Histogram:
    counts, _ = np.histogram(np.clip(values, edges[0], edges[-1]), bins=edges)
    return Histogram(tuple(float(e) for e in edges), tuple(int(c) for c in counts))


def _label_metrics(arm: _Arm, resamples: int, rng: np.random.Generator) -> LabelMetrics:
    known = arm.labels != UNLABELLED
    scores, labels, decisions = arm.scores[known], arm.labels[known], arm.decisions[known]
    review, decline = decisions != "APPROVE", decisions == "DECLINE"

    def figures(weights: np.ndarray) -> tuple[np.ndarray, ...]:
        return (
            stats.weighted_auc(scores, labels, weights),
            *stats.weighted_precision_recall(review, labels, weights),
            *stats.weighted_precision_recall(decline, labels, weights),
        )

    if len(scores) == 0:
        empty = Interval(math.nan, math.nan, math.nan)
        return LabelMetrics(0, 0, empty, empty, empty, empty, empty, ())
    points = figures(np.ones((1, len(scores))))
    resampled = stats.bootstrap(len(scores), resamples, rng, figures)
    auc, p_review, r_review, p_decline, r_decline = (
        stats.interval(float(point[0]), boot) for point, boot in zip(points, resampled, strict=True)
    )
    return LabelMetrics(
        labelled=int(known.sum()),
        positives=int(labels.sum()),
        auc=auc,
        precision_at_review=p_review,
        recall_at_review=r_review,
        precision_at_decline=p_decline,
        recall_at_decline=r_decline,
        roc=stats.roc_points(scores, labels),
    )


def _compare(
    champion: _Arm,
    challenger: _Arm,
    request_ids: np.ndarray,
    with_labels: bool,
    resamples: int,
    rng: np.random.Generator,
) -> Comparison:
    position = {rid: i for i, rid in enumerate(request_ids[champion.rows].tolist())}
    matched = [
        (position[rid], j)
        for j, rid in enumerate(request_ids[challenger.rows].tolist())
        if rid in position
    ]
    ci = np.array([m[0] for m in matched], dtype=np.int64)
    hi = np.array([m[1] for m in matched], dtype=np.int64)
    a, b = champion.scores[ci], challenger.scores[hi]
    confusion = {
        c: {
            h: int(np.sum((champion.decisions[ci] == c) & (challenger.decisions[hi] == h)))
            for h in DECISIONS
        }
        for c in DECISIONS
    }
    diff = np.abs(a - b)
    ks, ks_p = stats.ks_2samp(champion.scores, challenger.scores)
    delta, method = (None, None)
    if with_labels:
        delta, method = _auc_difference(champion, challenger, ci, hi, resamples, rng)
    return Comparison(
        challenger_version=challenger.version,
        pairs=len(matched),
        decision_agreement=float(np.mean(champion.decisions[ci] == challenger.decisions[hi]))
        if len(matched)
        else math.nan,
        confusion=confusion,
        pearson=stats.pearson(a, b),
        spearman=stats.spearman(a, b) if len(a) > 1 else math.nan,
        mean_abs_diff=float(diff.mean()) if len(diff) else math.nan,
        max_abs_diff=float(diff.max()) if len(diff) else math.nan,
        psi=stats.psi(champion.scores, challenger.scores),
        ks_statistic=ks,
        ks_pvalue=ks_p,
        auc_difference=delta,
        auc_difference_method=method,
        verdict=_verdict(delta),
    )


def _auc_difference(
    champion: _Arm,
    challenger: _Arm,
    ci: np.ndarray,
    hi: np.ndarray,
    resamples: int,
    rng: np.random.Generator,
) -> tuple[Interval, str]:
    """Paired bootstrap over shared labelled requests; else independent resamples per arm."""
    y = champion.labels[ci]
    known = (y != UNLABELLED) & (challenger.labels[hi] != UNLABELLED)
    if known.sum() >= 2:
        a, b, y = champion.scores[ci][known], challenger.scores[hi][known], y[known]

        def delta(weights: np.ndarray) -> tuple[np.ndarray, ...]:
            return (stats.weighted_auc(b, y, weights) - stats.weighted_auc(a, y, weights),)

        point = delta(np.ones((1, len(y))))[0][0]
        (boot,) = stats.bootstrap(len(y), resamples, rng, delta)
        return stats.interval(float(point), boot), "paired"
    sides = []
    for arm in (champion, challenger):
        keep = arm.labels != UNLABELLED
        s, y_arm = arm.scores[keep], arm.labels[keep]
        if len(s) < 2:
            return Interval(math.nan, math.nan, math.nan), "independent"

        def one(weights: np.ndarray, s: np.ndarray = s, y: np.ndarray = y_arm) -> tuple[np.ndarray]:
            return (stats.weighted_auc(s, y, weights),)

        sides.append((stats.auc(s, y_arm), stats.bootstrap(len(s), resamples, rng, one)[0]))
    point = sides[1][0] - sides[0][0]
    return stats.interval(point, sides[1][1] - sides[0][1]), "independent"


def _verdict(delta: Interval | None) -> str:
    if delta is None:
        return "no labels: quality not compared"
    if not (math.isfinite(delta.low) and math.isfinite(delta.high)):
        return "not enough labelled records to compare"
    if delta.low > 0:
        return "challenger better at 95%"
    if delta.high < 0:
        return "challenger worse at 95%"
    return "no significant difference at 95%"
