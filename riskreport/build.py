"""`build_report`: compare an experiment's arms from its logged records (and labels, if any).

DuckDB reads the Parquet log (only the columns each step names), joins the labels, numbers
the entities and pairs the arms on request id; counts, sums, latency quantiles, histograms,
Pearson and the decision confusion are SQL aggregates. What needs an order (AUC and its
placements, ranks for Spearman, KS, PSI) comes from DuckDB sorted and is consumed in batches
by one pass each (`stats.SortedPass`), so memory holds per-entity sums and each arm's sorted
scores, not the records. Every figure is exact; the histograms only draw the plots.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal

import duckdb
import numpy as np
import pyarrow.fs as pafs

from engines.manifest import Thresholds
from riskreport import stats
from riskreport.dataset import open_records, spooled_rows, sql_text, unreadable_files
from riskreport.labels import load_labels
from riskreport.stats import Interval, OrderedBatch, SortedPass
from service.explanations.reasons import TopReasonComparison

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
BATCH_ROWS = 1_000_000
BOOTSTRAP_BATCH_CELLS = 4_000_000

Progress = Callable[[str, int | None], None]
"""``progress(stage, count)``: called as each stage of a report starts or finishes; the stage
names what `count` counts (records, labels, entities or requests, paired requests)."""

Unit = Literal["entity", "request"]
_PLURAL: dict[str, str] = {"entity": "entities", "request": "requests"}


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
    """One challenger version against the champion; paired figures use the request ids both
    arms logged exactly once (records without one, or with a repeated one, pair with none)."""

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
    top_reason: TopReasonComparison | None = None
    """Over the paired requests where both arms gave reason codes: how many there are, and in
    how many the arms' top codes differ. None when no record of the log has reason codes."""
    shadowed: int = 0
    """Champion requests logged in shadow mode: the challenger's coverage is `pairs` of them.
    The rest have no answer of its: outside its shadow share, sampled out while the shadow
    worker was behind, or dropped."""
    repeated_request_ids: int = 0
    """Request ids logged more than once by the champion or by this challenger: left out of
    the pairs, since which answer goes with which is unknown."""

    @property
    def coverage(self) -> float | None:
        """Share of the champion's shadow-mode requests the challenger answered; None in A/B."""
        return self.pairs / self.shadowed if self.shadowed else None


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
    spooled_records: int = 0
    """Records read from open log files a running writer has not yet rolled into Parquet."""
    unreadable_files: tuple[str, ...] = ()
    """Parquet files left out because they cannot be read (cut short by a crash, say)."""

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
    influence: np.ndarray | None = None
    present: np.ndarray | None = None
    """Units with labelled records in this arm."""
    draws: np.ndarray | None = None


@dataclass(frozen=True)
class _Options:
    labels_key: str | None
    decision_sql: str
    unit: Unit
    resamples: int
    seed: int
    units: int = 0
    """Distinct units (entities or requests) numbered in the table ``units``."""

    @property
    def batch_rows(self) -> int:
        if self.resamples:
            return max(1_000, BOOTSTRAP_BATCH_CELLS // self.resamples)
        return BATCH_ROWS


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
        options = _Options(None, _decision_sql(thresholds), unit, bootstrap_resamples, seed)
        if labels_path:
            say("reading labels", None)
            key = load_labels(con, labels_path)
            say("labels read", _scalar(con, "SELECT count(*) FROM labels"))
            column = "entity_id" if unit == "entity" else "request_id"
            con.execute(
                "CREATE OR REPLACE TEMP TABLE units AS SELECT u, "
                "(row_number() OVER () - 1)::INTEGER AS code "
                f"FROM (SELECT DISTINCT hash({column}) AS u FROM records)"
            )
            options = replace(
                options, labels_key=key, units=_scalar(con, "SELECT count(*) FROM units")
            )
            say(f"{_PLURAL[unit]} numbered", options.units)
        return _report(con, options, say, start, end, thresholds)


def _report(
    con: duckdb.DuckDBPyConnection,
    options: _Options,
    say: Progress,
    start: datetime | None,
    end: datetime | None,
    thresholds: Thresholds | None,
) -> Report:
    overview = con.execute(
        "SELECT count(*), min(time), max(time), any_value(experiment), any_value(model), "
        "list(DISTINCT mode ORDER BY mode), list(DISTINCT replica_id ORDER BY replica_id) "
        "FROM records"
    ).fetchall()[0]
    records, first, last, experiment_name, model, modes, replicas = overview
    say("records read", int(records))
    arms = _arm_keys(con)
    with_reasons = bool(
        con.execute("SELECT bool_or(len(reason_codes) > 0) FROM records").fetchall()[0][0]
    )
    summaries: list[ArmSummary] = []
    parts: dict[tuple[str, str], _AucParts | None] = {}
    champion_scores: np.ndarray | None = None  # every champion version's, sorted
    challenger_scores: dict[str, np.ndarray] = {}
    for arm, version in arms:
        say(f"arm {arm} {version}: aggregates and ordered pass", None)
        summary, auc_parts, scores = _summarize(con, options, arm, version)
        summaries.append(summary)
        parts[(arm, version)] = auc_parts
        if arm != "champion":
            challenger_scores[version] = scores
        elif champion_scores is None:
            champion_scores = scores
        else:  # the champion changed inside the window: one baseline of all its versions
            champion_scores = np.sort(np.concatenate([champion_scores, scores]), kind="stable")
        say(f"arm {arm} {version} done, records", summary.records)
    comparisons = []
    champion_parts = [p for (arm, _), p in parts.items() if arm == "champion"]
    if champion_scores is not None:
        drift = {
            version: (stats.ks_2samp(champion_scores, scores), stats.psi(champion_scores, scores))
            for version, scores in challenger_scores.items()
        }
        del champion_scores, challenger_scores
        for arm, version in arms:
            if arm != "challenger":
                continue
            say(f"pairing champion with challenger {version}", None)
            comparison = _compare(
                con, options, version, drift[version],
                champion_parts[0] if len(champion_parts) == 1 else None, parts[(arm, version)],
            )  # fmt: skip
            if with_reasons:
                comparison = replace(comparison, top_reason=_top_reasons(con, version))
            comparisons.append(comparison)
            say(f"challenger {version} compared, paired requests", comparison.pairs)
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
        seed=options.seed,
        psi_bins=stats.PSI_BINS,
        arms=tuple(summaries),
        comparisons=tuple(comparisons),
        spooled_records=spooled_rows(con),
        unreadable_files=unreadable_files(con),
    )


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat()


def _scalar(con: duckdb.DuckDBPyConnection, sql: str) -> int:
    row = con.execute(sql).fetchall()[0]
    return int(row[0])


def _decision_sql(thresholds: Thresholds | None) -> str:
    if thresholds is None:
        return "decision"
    return (
        f"CASE WHEN score >= {thresholds.decline!r} THEN 'DECLINE' "
        f"WHEN score >= {thresholds.review!r} THEN 'REVIEW' ELSE 'APPROVE' END"
    )


def _decision_code(decision_sql: str) -> str:
    return f"(CASE ({decision_sql}) WHEN 'DECLINE' THEN 2 WHEN 'REVIEW' THEN 1 ELSE 0 END)::TINYINT"


def _arm_keys(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    keys = con.execute("SELECT DISTINCT arm, version FROM records").fetchall()
    return sorted(((str(a), str(v)) for a, v in keys), key=lambda k: (k[0] != "champion", k[1]))


def _where(arm: str, version: str) -> str:
    return f"arm = {sql_text(arm)} AND version = {sql_text(version)}"


def _summarize(
    con: duckdb.DuckDBPyConnection, options: _Options, arm: str, version: str
) -> tuple[ArmSummary, _AucParts | None, np.ndarray]:
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
    ).fetchall()[0]
    (p50, p99), low_latency, high_latency, low_score, high_score = row
    latency_edges = np.geomspace(
        low_latency or 1e-3, max(high_latency, (low_latency or 1e-3) * 1.01), HISTOGRAM_BINS + 1
    )
    score_edges = np.linspace(min(0.0, low_score), max(1.0, high_score), HISTOGRAM_BINS + 1)
    labels, auc_parts, scores = _ordered_pass(con, options, where, records)
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
        score_histogram=_histogram(scores, score_edges),
        latency_histogram=_latency_histogram(con, where, latency_edges),
        labels=labels,
    )
    return summary, auc_parts, scores


def _latency_measure(served: int, records: int) -> str:
    if served == records:
        return "served request, end to end"
    if served == 0:
        return "shadow engine call"
    return "mixed: served end to end and shadow engine calls"


def _histogram(values_sorted: np.ndarray, edges: np.ndarray) -> Histogram:
    cuts = np.searchsorted(values_sorted, edges, side="left")
    cuts[-1] = len(values_sorted)  # the last bin holds its right edge, as numpy's does
    return Histogram(tuple(float(e) for e in edges), tuple(int(c) for c in np.diff(cuts)))


def _latency_histogram(con: duckdb.DuckDBPyConnection, where: str, edges: np.ndarray) -> Histogram:
    low, high, bins = float(edges[0]), float(edges[-1]), len(edges) - 1
    position = f"ln(least(greatest(latency_ms, {low!r}), {high!r}) / {low!r}) / " + repr(
        math.log(high / low)
    )
    rows = con.execute(
        f"SELECT least({bins - 1}, floor({position} * {bins}))::INTEGER AS bin, count(*) "
        f"FROM records WHERE {where} GROUP BY 1"
    ).fetchall()
    counts = [0] * bins
    for index, count in rows:
        counts[max(0, index)] += count
    return Histogram(tuple(float(e) for e in edges), tuple(counts))


def _batches(
    con: duckdb.DuckDBPyConnection, sql: str, rows: int
) -> Iterator[dict[str, np.ndarray]]:
    for batch in con.sql(sql).to_arrow_reader(rows):
        yield {name: column.to_numpy() for name, column in zip(batch.schema.names, batch.columns,
                                                                strict=True)}  # fmt: skip


def _ordered_pass(
    con: duckdb.DuckDBPyConnection, options: _Options, where: str, records: int
) -> tuple[LabelMetrics | None, _AucParts | None, np.ndarray]:
    """The arm's records in score order: its sorted scores and, with labels, its AUC pass."""
    scores = np.empty(records)
    if options.labels_key is None:
        filled = 0
        for batch in _batches(con, f"SELECT score FROM records WHERE {where} ORDER BY score",
                              options.batch_rows):  # fmt: skip
            scores[filled : filled + len(batch["score"])] = batch["score"]
            filled += len(batch["score"])
        return None, None, scores
    ordered = SortedPass(
        options.units, resamples=options.resamples, seed=options.seed, rows=records
    )
    filled = 0
    sql = (
        f"SELECT r.score, coalesce(l.label, -1)::TINYINT AS label, u.code, "
        f"{_decision_code(options.decision_sql)} AS d FROM records r "
        f"LEFT {_label_join(options, 'r')} JOIN units u ON u.u = {_unit_key(options, 'r')} "
        f"WHERE {where} ORDER BY r.score"
    )
    for batch in _batches(con, sql, options.batch_rows):
        n = len(batch["score"])
        scores[filled : filled + n] = batch["score"]
        filled += n
        ordered.add(OrderedBatch(batch["score"], batch["label"], batch["code"],
                                 decisions=batch["d"]))  # fmt: skip
    ordered.finish()
    metrics, parts = _label_metrics(options, ordered)
    return metrics, parts, scores


def _label_join(options: _Options, alias: str) -> str:
    return f"JOIN labels l ON l.key = hash({alias}.{options.labels_key})"


def _unit_key(options: _Options, alias: str) -> str:
    column = "entity_id" if options.unit == "entity" else "request_id"
    return f"hash({alias}.{column})"


def _label_metrics(options: _Options, ordered: SortedPass) -> tuple[LabelMetrics, _AucParts]:
    labelled_units = (ordered.pos_per_cluster + ordered.neg_per_cluster) > 0
    positives_k = ordered.pos_per_cluster
    ratios = [
        (ordered.hits[1], ordered.flagged[1]),
        (ordered.hits[1], positives_k),
        (ordered.hits[2], ordered.flagged[2]),
        (ordered.hits[2], positives_k),
    ]
    area = ordered.auc
    if options.resamples > 0:
        draws = ordered.resampled_auc()
        intervals = [stats.percentile_interval(area, draws)]
        for numerator, denominator in ratios:
            ratio, _ = stats.ratio_influence(numerator, denominator)
            resampled = stats.resampled_ratio(numerator, denominator, options.resamples,
                                              options.seed)  # fmt: skip
            intervals.append(stats.percentile_interval(ratio, resampled))
        parts = _AucParts(area, draws=draws)
    else:
        influence = ordered.influence()
        intervals = [stats.normal_interval(area, _variance(influence, labelled_units))]
        for numerator, denominator in ratios:
            ratio, ratio_influence = stats.ratio_influence(numerator, denominator)
            variance = _variance(ratio_influence, labelled_units)
            intervals.append(stats.normal_interval(ratio, variance))
        parts = _AucParts(area, influence=influence, present=labelled_units)
    metrics = LabelMetrics(
        labelled=ordered.m + ordered.n,
        positives=ordered.m,
        entities=int(labelled_units.sum()),
        auc=intervals[0],
        precision_at_review=intervals[1],
        recall_at_review=intervals[2],
        precision_at_decline=intervals[3],
        recall_at_decline=intervals[4],
        roc=ordered.roc(),
    )
    return metrics, parts


def _variance(influence: np.ndarray, present: np.ndarray) -> float:
    """Cluster-robust variance over the units that have labelled records in this sample."""
    return stats.robust_variance(influence[present])


def _compare(
    con: duckdb.DuckDBPyConnection,
    options: _Options,
    version: str,
    drift: tuple[tuple[float, float], float],
    champion: _AucParts | None,
    challenger: _AucParts | None,
) -> Comparison:
    (ks, ks_p), psi = drift
    code = _decision_code(options.decision_sql)
    label = "coalesce(l.label, -1)::TINYINT" if options.labels_key else "-1::TINYINT"
    labels_join = f"LEFT {_label_join(options, 'c')}" if options.labels_key else ""
    unit = "u.code" if options.labels_key else "0"
    units_join = f"JOIN units u ON u.u = {_unit_key(options, 'c')}" if options.labels_key else ""
    champion_ids = _identified(_CHAMPION, {"entity_id": "entity_id", "score": "score", "d": code})
    challenger_ids = _identified(_where("challenger", version), {"score": "score", "d": code})
    con.execute(
        "CREATE OR REPLACE TEMP TABLE pairs AS SELECT "
        f"c.score AS a, h.score AS b, c.d AS da, h.d AS db, {label} AS label, {unit} AS code "
        f"FROM ({champion_ids}) c JOIN ({challenger_ids}) h "
        f"ON c.request_id = h.request_id {labels_join} {units_join}"
    )
    repeated = _scalar(con, _repeated_ids_sql(version))
    shadowed = _scalar(
        con, "SELECT count(*) FROM records WHERE arm = 'champion' AND mode = 'shadow'"
    )
    row = con.execute(
        "SELECT count(*), avg(abs(a - b)), max(abs(a - b)), avg(a), avg(b) FROM pairs"
    ).fetchall()[0]
    n, mean_abs, max_abs, mean_a, mean_b = row
    confusion = np.zeros((3, 3), dtype=np.int64)
    for da, db, count in con.execute("SELECT da, db, count(*) FROM pairs GROUP BY ALL").fetchall():
        confusion[da, db] = count
    agreeing = int(np.trace(confusion))
    pearson, spearman, delta, method = math.nan, math.nan, None, None
    paired: tuple[SortedPass, SortedPass] | None = None
    if n:
        moments = con.execute(
            f"SELECT sum((a - {mean_a!r}) * (b - {mean_b!r})), sum((a - {mean_a!r}) ^ 2), "
            f"sum((b - {mean_b!r}) ^ 2) FROM pairs"
        ).fetchall()[0]
        ab, aa, bb = moments
        pearson = ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 else math.nan
        spearman, paired = _paired_passes(con, options, int(n))
    if options.labels_key is not None:
        delta, method = _auc_difference(options, paired, champion, challenger)
    con.execute("DROP TABLE pairs")
    return Comparison(
        challenger_version=version,
        pairs=int(n),
        decision_agreement=agreeing / n if n else math.nan,
        decision_flips=int(n) - agreeing,
        confusion={
            c: {h: int(confusion[i, j]) for j, h in enumerate(DECISIONS)}
            for i, c in enumerate(DECISIONS)
        },
        pearson=pearson,
        spearman=spearman,
        mean_abs_diff=float(mean_abs) if n else math.nan,
        max_abs_diff=float(max_abs) if n else math.nan,
        psi=psi,
        ks_statistic=ks,
        ks_pvalue=ks_p,
        auc_difference=delta,
        auc_difference_method=method if delta is not None else None,
        verdict=_verdict(delta),
        shadowed=shadowed,
        repeated_request_ids=repeated,
    )


_CHAMPION = "arm = 'champion'"


def _identified(where: str, columns: dict[str, str]) -> str:
    """SQL: one row per request id that occurs once among the records `where` selects, with
    `columns` (name: expression) of its record. A request logged without an id (an empty
    one, from older servers) pairs with nothing; nor does an id logged twice in an arm (a
    client reusing ids), as which answer goes with which is unknown."""
    picked = ", ".join(f"any_value({expression}) AS {name}" for name, expression in columns.items())
    return (
        f"SELECT request_id, {picked} FROM records WHERE {where} AND request_id <> '' "
        "GROUP BY request_id HAVING count(*) = 1"
    )


def _repeated_ids_sql(version: str) -> str:
    """SQL: how many request ids `_identified` leaves out of the pairs by repeating in the
    champion's records or in challenger `version`'s."""
    arm = f"(CASE WHEN {_CHAMPION} THEN 'champion' ELSE 'challenger' END)"
    return (
        "SELECT count(DISTINCT request_id) FROM (SELECT request_id FROM records "
        f"WHERE ({_CHAMPION} OR ({_where('challenger', version)})) AND request_id <> '' "
        f"GROUP BY request_id, {arm} HAVING count(*) > 1)"
    )


def _top_reasons(con: duckdb.DuckDBPyConnection, version: str) -> TopReasonComparison:
    """`reasons.compare_top_reasons` in SQL: the requests paired as `_compare` pairs them, where
    both arms gave a reason."""
    top = {"code": "CASE WHEN len(reason_codes) > 0 THEN reason_codes[1] END"}
    champion = _identified(_CHAMPION, top)
    challenger = _identified(_where("challenger", version), top)
    pairs, differing = con.execute(
        f"SELECT count(*), count(*) FILTER (c.code <> h.code) FROM ({champion}) c "
        f"JOIN ({challenger}) h ON c.request_id = h.request_id "
        "WHERE c.code IS NOT NULL AND h.code IS NOT NULL"
    ).fetchall()[0]
    return TopReasonComparison(int(pairs), int(differing))


def _paired_passes(
    con: duckdb.DuckDBPyConnection, options: _Options, n: int
) -> tuple[float, tuple[SortedPass, SortedPass] | None]:
    """Spearman over the pairs and, with labels, each arm's AUC pass over the same pairs."""
    twice_rank_a = np.zeros(n, dtype=np.uint32 if 2 * n + 1 < 2**32 else np.uint64)
    centre = (n + 1) / 2
    cross = 0.0

    def keep(ids: np.ndarray, twice_rank: np.ndarray) -> None:
        twice_rank_a[ids] = twice_rank

    def multiply(ids: np.ndarray, twice_rank: np.ndarray) -> None:
        nonlocal cross
        cross += float(np.dot(twice_rank_a[ids] / 2 - centre, twice_rank / 2 - centre))

    passes = []
    for column, sink in (("a", keep), ("b", multiply)):
        ordered = SortedPass(
            max(options.units, 1), resamples=options.resamples, seed=options.seed,
            rank_sink=sink, rows=n,
        )  # fmt: skip
        sql = f"SELECT {column} AS score, label, code, rowid AS id FROM pairs ORDER BY {column}"
        for batch in _batches(con, sql, options.batch_rows):
            ordered.add(OrderedBatch(batch["score"], batch["label"], batch["code"], batch["id"]))
        passes.append(ordered.finish())
    spread = math.sqrt(passes[0].rank_sum_sq * passes[1].rank_sum_sq)
    spearman = cross / spread if spread > 0 else math.nan
    labelled = passes[0].m > 0 and passes[0].n > 0
    return spearman, (passes[0], passes[1]) if labelled else None


def _auc_difference(
    options: _Options,
    paired: tuple[SortedPass, SortedPass] | None,
    champion: _AucParts | None,
    challenger: _AucParts | None,
) -> tuple[Interval, str]:
    """Paired over shared labelled requests; else from each arm's own records."""
    if paired is not None:
        first, second = paired
        point = second.auc - first.auc
        if options.resamples > 0:
            draws = second.resampled_auc() - first.resampled_auc()
            return stats.percentile_interval(point, draws), "paired"
        present = (first.pos_per_cluster + first.neg_per_cluster) > 0
        variance = _variance(second.influence() - first.influence(), present)
        return stats.normal_interval(point, variance), "paired"
    if champion is None or challenger is None:
        return Interval(math.nan, math.nan, math.nan), "independent"
    point = challenger.point - champion.point
    if champion.draws is not None and challenger.draws is not None:
        # One weight per unit and resample in both arms: an entity in both counts once.
        return stats.percentile_interval(point, challenger.draws - champion.draws), "independent"
    if champion.influence is None or challenger.influence is None:
        return Interval(math.nan, math.nan, math.nan), "independent"
    combined = challenger.influence - champion.influence
    present = champion.present | challenger.present  # type: ignore[operator]
    return stats.normal_interval(point, _variance(combined, present)), "independent"


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
    """A `Progress` that prints the seconds since it was made, the stage and its count."""
    started = time.monotonic()

    def show(stage: str, count: int | None) -> None:
        counted = "" if count is None else f": {count:,}"
        print(f"[{time.monotonic() - started:7.1f} s] {stage}{counted}", file=stream, flush=True)

    return show
