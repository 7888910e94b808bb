"""The report's key figures as a plain-text table for the terminal."""

from __future__ import annotations

import math

from riskreport.build import Comparison, Report
from riskreport.stats import Interval
from service.explanations.reasons import TopReasonComparison

__all__ = ["render_summary"]


def _number(value: float, digits: int = 4) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.{digits}f}"


def _interval(value: Interval | None, signed: bool = False) -> str:
    if value is None or not math.isfinite(value.estimate):
        return "n/a"
    sign = "+" if signed else ""
    point = f"{value.estimate:{sign}.4f}"
    if not (math.isfinite(value.low) and math.isfinite(value.high)):
        return f"{point} [n/a]"
    return f"{point} [{value.low:{sign}.4f}, {value.high:{sign}.4f}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join

    def fit(row: list[str]) -> str:
        return line(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                    enumerate(zip(row, widths, strict=True))).rstrip()  # fmt: skip

    return [fit(header), line("-" * w for w in widths), *(fit(r) for r in rows)]


def _units(unit: str) -> str:
    return {"entity": "entities", "request": "requests"}.get(unit, unit)


def _top_reason(figure: TopReasonComparison) -> str:
    share = "n/a" if figure.share is None else f"{100 * figure.share:.2f}%"
    return f"{share} of {figure.pairs:,} requests where both arms gave reasons"


def _coverage(c: Comparison) -> list[str]:
    if c.coverage is None:
        return []
    return [
        f"  coverage {100 * c.coverage:.2f}%: {c.pairs:,} of {c.shadowed:,} champion requests "
        f"in shadow mode have its answer, {c.shadowed - c.pairs:,} have none (outside its "
        "share, sampled out while the shadow worker was behind, or dropped)"
    ]


def _repeated(c: Comparison) -> list[str]:
    n = c.repeated_request_ids
    if not n:
        return []
    ids = "request id appears" if n == 1 else "request ids appear"
    return [f"  {n:,} {ids} more than once in an arm: left unpaired"]


def _unreadable(report: Report) -> list[str]:
    n = len(report.unreadable_files)
    if not n:
        return []
    files = "file" if n == 1 else "files"
    return [f"{n:,} unreadable Parquet {files} skipped (named in the warnings and the JSON)"]


def render_summary(report: Report) -> str:
    """Per arm: records, labelled, AUC with interval; per challenger: the comparison."""
    method = (
        f"Poisson bootstrap, {report.bootstrap_resamples} resamples"
        if report.interval_method == "bootstrap"
        else "analytic (DeLong for AUC, delta method for ratios)"
    )
    lines = [
        f"experiment {report.experiment} (model {report.model}, {', '.join(report.modes)}): "
        f"{report.records:,} records from {len(report.replicas)} replica(s)"
        + (
            f", {report.spooled_records:,} of them from open log files not yet rolled"
            if report.spooled_records
            else ""
        ),
        *_unreadable(report),
        f"records from {report.first_record} to {report.last_record}",
        f"95% intervals: {method}, resampling unit: {report.interval_unit}",
        "",
    ]
    rows = []
    for arm in report.arms:
        m = arm.labels
        rows.append([
            arm.arm, arm.version, f"{arm.records:,}",
            "-" if m is None else f"{m.labelled:,}",
            "-" if m is None else f"{m.entities:,}",
            "-" if m is None else _interval(m.auc),
        ])  # fmt: skip
    lines += _table(
        ["arm", "version", "records", "labelled", _units(report.interval_unit), "AUC [95% CI]"],
        rows,
    )
    for c in report.comparisons:
        lines += [
            "",
            f"challenger {c.challenger_version} vs champion: {c.pairs:,} paired requests",
            *_coverage(c),
            *_repeated(c),
            f"  AUC difference (challenger - champion): {_interval(c.auc_difference, True)}"
            + (f" ({c.auc_difference_method})" if c.auc_difference_method else ""),
            f"  PSI {_number(c.psi)}   KS {_number(c.ks_statistic)} (p {c.ks_pvalue:.3g})",
            f"  decision agreement {_number(100 * c.decision_agreement, 2)}%, "
            f"flips {c.decision_flips:,}",
            f"  verdict: {c.verdict}",
        ]
        if c.top_reason is not None:
            lines.append(f"  top reason differs: {_top_reason(c.top_reason)}")
    return "\n".join(lines)
