"""`build_report`: compare an experiment's arms from its logged records (and labels, if any).

DuckDB reads the Parquet log (only the columns each step names), joins labels and pairs the
arms on request id, and computes the counts, sums, latency quantiles and histograms as
aggregates. What needs an order (AUC, KS, PSI, Spearman) is computed in numpy from one sorted
array per arm, fetched one arm at a time so that memory stays bounded. Every figure is exact:
the histograms only draw the plots.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import duckdb
import numpy as np
import pyarrow.fs as pafs

from engines.manifest import Thresholds
from service.shadow.report import stats
from service.shadow.report.dataset import open_records, sql_text
from service.shadow.report.labels import load_labels
from service.shadow.report.stats import Clusters, Interval, Ranked

__all__ = [
    "DECISIONS",
    "ArmSummary",
    "Comparison",
    "Histogram",
    "LabelMetrics",
    "Progress",
    "Report",
    "build_report",
]

DECISIONS = ("APPROVE", "REVIEW", "DECLINE")
DEFAULT_RESAMPLES = 0
DEFAULT_SEED = 20240601
DEFAULT_MEMORY_LIMIT = "1GB"
HISTOGRAM_BINS = 40

Progress = Callable[[str, int | None], None]
"""``progress(stage, rows)``: called as each stage of a report starts or finishes."""

Unit = Literal["entity", "request"]


@dataclass(frozen=True, slots=True)
class Histogram:
    edges: tuple[float, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LabelMetrics:
    """Quality against labels; "at review" means flagged = REVIEW or DECLINE."""

    labelled: int
    positives: int
    entities: int
    """Distinct units (entities, or requests) among the labelled records: the clusters."""
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
    latency_measure: str
    """What `latency_ms` times for this arm: the served request end to end, or the shadow
    worker's engine call (a challenger in shadow mode)."""
    score_histogram: Histogram
    latency_histogram: Histogram
    labels: LabelMetrics | None


@dataclass(frozen=True, slots=True)
class Comparison:
    """One challenger version against the champion; paired figures use shared request_ids."""

    challenger_version: str
    pairs: int
    decision_agreement: float
    decision_flips: int
    """Paired requests whose decision differs between the arms."""
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
    first_record: str
    last_record: str
    generated_at: str
    records: int
    replicas: tuple[str, ...]
    thresholds: dict[str, float] | None
    """Review/decline cut-offs used; None means the logged decisions were used."""
    interval_method: str
    """"analytic" (clustered DeLong for AUC, delta method for ratios) or "bootstrap"."""
    interval_unit: str
    """What the intervals treat as independent: "entity" or "request"."""
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


@dataclass(frozen=True)
class _AucParts:
    """One arm's AUC and what its interval came from, kept for the arms' difference."""

    point: float
    keys: np.ndarray | None = None
    influence: np.ndarray | None = None
    draws: np.ndarray | None = None


@dataclass(frozen=True)
class _Options:
    labels_key: str | None
    decision_sql: str
    unit: Unit
    resamples: int
    rng: np.random.Generator


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
    unit: Unit = "entity",
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    threads: int | None = None,
    progress: Progress | None = None,
) -> Report:
    """Read all replicas' records under `prefix` and compare champion and challengers.

    With `thresholds` the decisions are recomputed from the scores (e.g. the manifest's);
    without, the logged decisions are used. Intervals are analytic when `bootstrap_resamples`
    is 0, else a Poisson bootstrap with that many resamples; either way over `unit`s.
    `memory_limit` caps DuckDB's memory (it spills to a temporary folder beyond it).
    Raises `NoRecords` when nothing matches.
    """
    say = progress or (lambda stage, rows: None)
    with duckdb.connect(config={"memory_limit": memory_limit}) as con:
        con.execute(f"SET temp_directory = {sql_text(tempfile.gettempdir())}")
        if threads is not None:
            con.execute(f"SET threads = {int(threads)}")
        say("scanning the log", None)
        open_records(
            con, prefix, experiment=experiment, start=start, end=end, filesystem=filesystem
        )
        labels_key = None
        if labels_path:
            say("reading labels", None)
            labels_key = load_labels(con, labels_path)
            say("labels read", _scalar(con, "SELECT count(*) FROM labels"))
        options = _Options(
            labels_key, _decision_sql(thresholds), unit, bootstrap_resamples,
            np.random.default_rng(seed),
        )  # fmt: skip
        return _report(con, options, say, start, end, thresholds, seed)


def _report(
    con: duckdb.DuckDBPyConnection,
    options: _Options,
    say: Progress,
    start: datetime | None,
    end: datetime | None,
    thresholds: Thresholds | None,
    seed: int,
) -> Report:
    overview = con.execute(
        "SELECT count(*), min(time), max(time), any_value(experiment), any_value(model), "
        "list(DISTINCT mode ORDER BY mode), list(DISTINCT replica_id ORDER BY replica_id) "
        "FROM records"
    ).fetchone()
    assert overview is not None
    records, first, last, experiment_name, model, modes, replicas = overview
    say("records read", int(records))
    arms = _arm_keys(con)
    say("aggregating per arm", int(records))
    summaries, influences = [], {}
    for arm, version in arms:
        summary, influence = _summarize(con, options, arm, version)
        summaries.append(summary)
        influences[(arm, version)] = influence
        say(f"arm {arm} {version} done", summary.records)
    comparisons = []
    if any(a == "champion" for a, _ in arms):
        champion = _sorted_scores(con, "arm = 'champion'")
        for arm, version in arms:
            if arm != "challenger":
                continue
            say(f"pairing champion with challenger {version}", None)
            champion_influence = _merged_champion_influence(influences)
            comparisons.append(
                _compare(con, options, champion, version, champion_influence,
                         influences[(arm, version)])  # fmt: skip
            )
            say(f"challenger {version} compared", comparisons[-1].pairs)
    return Report(
        experiment=experiment_name,
        model=model,
        modes=tuple(modes),
        start=start.isoformat() if start else None,
        end=end.isoformat() if end else None,
        first_record=_iso(first),
        last_record=_iso(last),
        generated_at=datetime.now(UTC).isoformat(),
        records=int(records),
        replicas=tuple(replicas),
        thresholds=None
        if thresholds is None
        else {"review": thresholds.review, "decline": thresholds.decline},
        interval_method="bootstrap" if options.resamples > 0 else "analytic",
        interval_unit=options.unit,
        bootstrap_resamples=options.resamples,
        seed=seed,
        psi_bins=stats.PSI_BINS,
        arms=tuple(summaries),
        comparisons=tuple(comparisons),
    )


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat()


def _scalar(con: duckdb.DuckDBPyConnection, sql: str) -> int:
    row = con.execute(sql).fetchone()
    return int(row[0]) if row else 0


def _decision_sql(thresholds: Thresholds | None) -> str:
    if thresholds is None:
        return "decision"
    return (
        f"CASE WHEN score >= {thresholds.decline!r} THEN 'DECLINE' "
        f"WHEN score >= {thresholds.review!r} THEN 'REVIEW' ELSE 'APPROVE' END"
    )


def _decision_code(decision_sql: str) -> str:
    return (
        f"(CASE ({decision_sql}) WHEN 'DECLINE' THEN 2 WHEN 'REVIEW' THEN 1 ELSE 0 END)::TINYINT"
    )


def _arm_keys(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    keys = con.execute("SELECT DISTINCT arm, version FROM records").fetchall()
    return sorted(((str(a), str(v)) for a, v in keys), key=lambda k: (k[0] != "champion", k[1]))


def _where(arm: str, version: str) -> str:
    return f"arm = {sql_text(arm)} AND version = {sql_text(version)}"


def _summarize(
    con: duckdb.DuckDBPyConnection, options: _Options, arm: str, version: str
) -> tuple[ArmSummary, _AucParts | None]:
    where = _where(arm, version)
    cells = con.execute(
        f"SELECT engine, served, {options.decision_sql} AS d, count(*), sum(score) "
        f"FROM records WHERE {where} GROUP BY ALL"
    ).fetchall()
    engines: dict[str, int] = {}
    decisions = dict.fromkeys(DECISIONS, 0)
    records = served = 0
    score_sum = 0.0
    for engine, was_served, decision, count, score_total in cells:
        engines[engine] = engines.get(engine, 0) + count
        if decision in decisions:
            decisions[decision] += count
        records += count
        served += count if was_served else 0
        score_sum += score_total
    row = con.execute(
        "SELECT quantile_cont(latency_ms, [0.5, 0.99]), min(latency_ms) FILTER (latency_ms > 0), "
        f"max(latency_ms), min(score), max(score) FROM records WHERE {where}"
    ).fetchone()
    assert row is not None
    (p50, p99), low_latency, high_latency, low_score, high_score = row
    latency_edges = np.geomspace(
        low_latency or 1e-3, max(high_latency, (low_latency or 1e-3) * 1.01), HISTOGRAM_BINS + 1
    )
    score_edges = np.linspace(min(0.0, low_score), max(1.0, high_score), HISTOGRAM_BINS + 1)
    labels, influence = (None, None)
    if options.labels_key is not None:
        labels, influence = _label_metrics(con, options, where)
    summary = ArmSummary(
        arm=arm,
        version=version,
        records=records,
        served=served,
        engines=dict(sorted(engines.items())),
        decisions=decisions,
        score_mean=score_sum / records,
        latency_ms_p50=float(p50),
        latency_ms_p99=float(p99),
        latency_measure=_latency_measure(served, records),
        score_histogram=_histogram(con, where, "score", score_edges, log=False),
        latency_histogram=_histogram(con, where, "latency_ms", latency_edges, log=True),
        labels=labels,
    )
    return summary, influence


def _latency_measure(served: int, records: int) -> str:
    if served == records:
        return "served request, end to end"
    if served == 0:
        return "shadow engine call"
    return "mixed: served end to end and shadow engine calls"


def _histogram(
    con: duckdb.DuckDBPyConnection, where: str, column: str, edges: np.ndarray, *, log: bool
) -> Histogram:
    low, high, bins = float(edges[0]), float(edges[-1]), len(edges) - 1
    value = f"least(greatest({column}, {low!r}), {high!r})"
    position = (
        f"ln({value} / {low!r}) / {math.log(high / low)!r}"
        if log
        else f"({value} - {low!r}) / {high - low!r}"
    )
    rows = con.execute(
        f"SELECT least({bins - 1}, floor({position} * {bins}))::INTEGER AS bin, count(*) "
        f"FROM records WHERE {where} GROUP BY 1"
    ).fetchall()
    counts = [0] * bins
    for index, count in rows:
        counts[max(0, index)] += count
    return Histogram(tuple(float(e) for e in edges), tuple(counts))


def _label_join(options: _Options, alias: str) -> str:
    return f"JOIN labels l ON l.key = hash({alias}.{options.labels_key})"


def _unit_key(options: _Options, alias: str) -> str:
    column = "entity_id" if options.unit == "entity" else "request_id"
    return f"hash({alias}.{column})"


def _label_metrics(
    con: duckdb.DuckDBPyConnection, options: _Options, where: str
) -> tuple[LabelMetrics, _AucParts | None]:
    data = con.execute(
        f"SELECT r.score, l.label, {_unit_key(options, 'r')} AS unit, "
        f"{_decision_code(options.decision_sql)} AS d FROM records r "
        f"{_label_join(options, 'r')} WHERE {where}"
    ).fetchnumpy()
    scores, labels, decision = data["score"], data["label"].astype(np.int8), data["d"]
    if len(scores) == 0:
        empty = Interval(math.nan, math.nan, math.nan)
        return LabelMetrics(0, 0, 0, empty, empty, empty, empty, empty, ()), None
    clusters = Clusters(data["unit"])
    del data
    ranked = Ranked(scores, labels)
    positive = (labels == 1).astype(np.float64)
    review, decline = (decision >= 1).astype(np.float64), (decision == 2).astype(np.float64)
    ratios = [
        (review * positive, review),
        (review * positive, positive),
        (decline * positive, decline),
        (decline * positive, positive),
    ]
    area, auc_influence = stats.auc_influence(scores, labels, clusters, ranked)
    if options.resamples > 0:

        def figures(weights: np.ndarray) -> tuple[np.ndarray, ...]:
            with np.errstate(invalid="ignore", divide="ignore"):
                quotients = [(weights @ n) / (weights @ d) for n, d in ratios]
            return (ranked.auc(weights[:, ranked.order]), *quotients)

        draws = stats.poisson_bootstrap(clusters, options.resamples, options.rng, figures)
        points = [area] + [_ratio(n, d) for n, d in ratios]
        intervals = [
            stats.percentile_interval(p, d) for p, d in zip(points, draws, strict=True)
        ]
        kept = _AucParts(area, draws=draws[0])
    else:
        intervals = [stats.normal_interval(area, stats.robust_variance(auc_influence))]
        for numerator, denominator in ratios:
            ratio, influence = stats.ratio_influence(numerator, denominator, clusters)
            intervals.append(stats.normal_interval(ratio, stats.robust_variance(influence)))
        kept = _AucParts(area, keys=clusters.keys, influence=auc_influence)
    metrics = LabelMetrics(
        labelled=len(scores),
        positives=int(positive.sum()),
        entities=clusters.count,
        auc=intervals[0],
        precision_at_review=intervals[1],
        recall_at_review=intervals[2],
        precision_at_decline=intervals[3],
        recall_at_decline=intervals[4],
        roc=stats.roc_points(ranked),
    )
    return metrics, kept


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> float:
    total = float(denominator.sum())
    return float(numerator.sum()) / total if total else math.nan


def _sorted_scores(con: duckdb.DuckDBPyConnection, where: str) -> np.ndarray:
    scores = con.execute(f"SELECT score FROM records WHERE {where}").fetchnumpy()["score"]
    scores.sort(kind="stable")
    return scores


def _merged_champion_influence(
    influences: dict[tuple[str, str], _AucParts | None],
) -> _AucParts | None:
    champions = [v for (arm, _), v in influences.items() if arm == "champion"]
    return champions[0] if len(champions) == 1 else None


def _compare(
    con: duckdb.DuckDBPyConnection,
    options: _Options,
    champion_sorted: np.ndarray,
    version: str,
    champion_influence: _AucParts | None,
    challenger_influence: _AucParts | None,
) -> Comparison:
    challenger_sorted = _sorted_scores(con, _where("challenger", version))
    ks, ks_p = stats.ks_2samp(champion_sorted, challenger_sorted)
    drift = stats.psi(champion_sorted, challenger_sorted)
    del challenger_sorted
    label = "l.label" if options.labels_key else "-1"
    join = f"LEFT {_label_join(options, 'c')}" if options.labels_key else ""
    code = _decision_code(options.decision_sql)
    pairs = con.execute(
        f"SELECT c.score AS a, h.score AS b, c.d AS da, h.d AS db, "
        f"coalesce({label}, -1)::TINYINT AS y, c.unit FROM "
        f"(SELECT request_id, entity_id, score, {code} AS d, {_unit_key(options, 'records')} "
        "AS unit FROM records WHERE arm = 'champion') c JOIN "
        f"(SELECT request_id, score, {code} AS d FROM records "
        f"WHERE {_where('challenger', version)}) h "
        f"ON hash(c.request_id) = hash(h.request_id) {join}"
    ).fetchnumpy()
    a, b = pairs["a"], pairs["b"]
    n = len(a)
    confusion_counts = np.bincount(
        pairs["da"].astype(np.int64) * 3 + pairs["db"], minlength=9
    ).reshape(3, 3)
    agreeing = int(np.trace(confusion_counts))
    diff = np.abs(a - b)
    delta, method = (None, None)
    if options.labels_key is not None:
        delta, method = _auc_difference(
            options, pairs, champion_influence, challenger_influence
        )
    return Comparison(
        challenger_version=version,
        pairs=n,
        decision_agreement=agreeing / n if n else math.nan,
        decision_flips=n - agreeing,
        confusion={
            c: {h: int(confusion_counts[i, j]) for j, h in enumerate(DECISIONS)}
            for i, c in enumerate(DECISIONS)
        },
        pearson=stats.pearson(a, b),
        spearman=stats.spearman(a, b),
        mean_abs_diff=float(diff.mean()) if n else math.nan,
        max_abs_diff=float(diff.max()) if n else math.nan,
        psi=drift,
        ks_statistic=ks,
        ks_pvalue=ks_p,
        auc_difference=delta,
        auc_difference_method=method,
        verdict=_verdict(delta),
    )


def _auc_difference(
    options: _Options,
    pairs: dict[str, np.ndarray],
    champion: _AucParts | None,
    challenger: _AucParts | None,
) -> tuple[Interval, str]:
    """Paired over shared labelled requests; else from each arm's own records."""
    y = pairs["y"]
    known = y >= 0
    if known.sum() >= 2 and 0 < (y[known] == 1).sum() < known.sum():
        everything = bool(known.all())
        a = pairs["a"] if everything else pairs["a"][known]
        b = pairs["b"] if everything else pairs["b"][known]
        y = y if everything else y[known]
        clusters = Clusters(pairs["unit"] if everything else pairs["unit"][known])
        ranked_a, ranked_b = Ranked(a, y), Ranked(b, y)
        point = float(ranked_b.auc()[0] - ranked_a.auc()[0])
        if options.resamples > 0:

            def delta(weights: np.ndarray) -> tuple[np.ndarray]:
                return (
                    ranked_b.auc(weights[:, ranked_b.order])
                    - ranked_a.auc(weights[:, ranked_a.order]),
                )

            (draws,) = stats.poisson_bootstrap(clusters, options.resamples, options.rng, delta)
            return stats.percentile_interval(point, draws), "paired"
        del ranked_a, ranked_b
        _, influence_a = stats.auc_influence(a, y, clusters)
        _, influence_b = stats.auc_influence(b, y, clusters)
        variance = stats.robust_variance(influence_b - influence_a)
        return stats.normal_interval(point, variance), "paired"
    if champion is None or challenger is None:
        return Interval(math.nan, math.nan, math.nan), "independent"
    point = challenger.point - champion.point
    if champion.draws is not None and challenger.draws is not None:
        return stats.percentile_interval(point, challenger.draws - champion.draws), "independent"
    if champion.keys is None or challenger.keys is None:
        return Interval(math.nan, math.nan, math.nan), "independent"
    # Both arms' influences on one set of units: an entity seen by both arms counts once.
    keys = np.union1d(champion.keys, challenger.keys)
    combined = np.zeros(len(keys))
    np.add.at(combined, np.searchsorted(keys, challenger.keys), challenger.influence)
    np.subtract.at(combined, np.searchsorted(keys, champion.keys), champion.influence)
    return stats.normal_interval(point, stats.robust_variance(combined)), "independent"


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


def elapsed_printer(stream: Any) -> Progress:
    """A `Progress` that prints the seconds since it was made, the stage and the rows."""
    started = time.monotonic()

    def show(stage: str, rows: int | None) -> None:
        count = "" if rows is None else f": {rows:,} rows"
        print(f"[{time.monotonic() - started:7.1f} s] {stage}{count}", file=stream, flush=True)

    return show
