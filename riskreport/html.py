"""`render_html`: one self-contained page for a report, plots inline as base64 PNG."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable
from typing import Any

from riskreport.build import DECISIONS, Report
from service.explanations.reasons import TopReasonComparison

__all__ = ["render_html"]

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:right;white-space:nowrap}th{background:#f3f3f3}.verdict{font-size:1.2em;
font-weight:bold}
img{max-width:100%;border:1px solid #eee}.ci{color:#555;font-size:.85em}
"""


def _unreadable(report: Report) -> list[str]:
    if not report.unreadable_files:
        return []
    names = ", ".join(_e(name) for name in report.unreadable_files)
    return [f"<p>{len(report.unreadable_files)} unreadable Parquet file(s) skipped: {names}.</p>"]


def render_html(report: Report) -> str:
    """The report as a complete HTML document that needs no network or other files."""
    parts = [
        f"<h1>Experiment {_e(report.experiment)} ({_e(report.model)})</h1>",
        f"<p>{report.records} records from {len(report.replicas)} replica(s); "
        f"modes {_e(', '.join(report.modes))}; first record {_e(report.first_record)}, "
        f"last {_e(report.last_record)}{_e(_window(report))}; thresholds "
        f"{_e(_thresholds(report))}.</p>",
        f"<p>95% intervals: {_e(_method(report))}; resampling unit: "
        f"{_e(report.interval_unit)}.</p>",
        *_unreadable(report),
        "<h2>Arms</h2>",
        _arms_table(report),
    ]
    for comparison in report.comparisons:
        parts += [
            f"<h2>Champion vs challenger {_e(comparison.challenger_version)}</h2>",
            f'<p class="verdict">{_e(comparison.verdict)}</p>',
            _table(
                ["figure", "value"],
                [
                    ["paired requests", comparison.pairs],
                    ["champion requests in shadow mode", comparison.shadowed],
                    [
                        "coverage (paired / champion in shadow mode)",
                        "n/a" if comparison.coverage is None else comparison.coverage,
                    ],
                    [
                        "request ids repeated in an arm (unpaired)",
                        comparison.repeated_request_ids,
                    ],
                    ["decision agreement", comparison.decision_agreement],
                    ["decision flips", comparison.decision_flips],
                    ["Pearson", comparison.pearson],
                    ["Spearman", comparison.spearman],
                    ["mean |diff|", comparison.mean_abs_diff],
                    ["max |diff|", comparison.max_abs_diff],
                    [f"PSI ({report.psi_bins} champion-quantile bins)", comparison.psi],
                    ["KS statistic", comparison.ks_statistic],
                    ["KS p-value", comparison.ks_pvalue],
                    ["AUC difference (challenger - champion)", _ci(comparison.auc_difference)],
                    *_top_reason_rows(comparison.top_reason),
                ],
            ),
            "<h3>Decisions: champion (rows) x challenger (columns)</h3>",
            _table(
                ["", *DECISIONS],
                [[c, *(comparison.confusion[c][h] for h in DECISIONS)] for c in DECISIONS],
            ),
        ]
    parts += ["<h2>Plots</h2>", _img(_score_plot, report), _img(_latency_plot, report)]
    if any(arm.labels and arm.labels.roc for arm in report.arms):
        parts.append(_img(_roc_plot, report))
    body = "\n".join(parts)
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>Experiment {_e(report.experiment)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}<p><small>generated {_e(report.generated_at)}</small></p></body></html>"
    )


def _top_reason_rows(figure: TopReasonComparison | None) -> list[list[Any]]:
    if figure is None:
        return []
    share = math.nan if figure.share is None else figure.share
    return [
        ["pairs where both arms gave reasons", figure.pairs],
        ["top reason differs", share],
    ]


def _e(text: str) -> str:
    return html.escape(str(text))


def _window(report: Report) -> str:
    if report.start is None and report.end is None:
        return ""
    return f" (window asked: {report.start or 'the first record'} to {report.end or 'the last'})"


def _method(report: Report) -> str:
    if report.interval_method == "bootstrap":
        unit, resamples = report.interval_unit, report.bootstrap_resamples
        return f"Poisson bootstrap over each {unit}, {resamples} resamples"
    return "analytic: DeLong for AUC, the delta method for precision and recall"


def _thresholds(report: Report) -> str:
    t = report.thresholds
    return "logged decisions" if t is None else f"review {t['review']}, decline {t['decline']}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.4g}"
    return _e(str(value))


def _ci(interval: Any) -> str:
    if interval is None:
        return "n/a"
    # The interval on a line of its own: a wide table's cells break there and nowhere else.
    bounds = f"[{_fmt(interval.low)}, {_fmt(interval.high)}]"
    return f'{_fmt(interval.estimate)}<br><span class="ci">{bounds}</span>'


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{c if isinstance(c, str) else _fmt(c)}</td>" for c in row) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _arms_table(report: Report) -> str:
    volume = _table(
        ["arm", "version", "records", "served", "latency p50 ms", "latency p99 ms",
         "latency timed", "approve / review / decline"],
        [[_e(a.arm), _e(a.version), a.records, a.served, a.latency_ms_p50, a.latency_ms_p99,
          _e(a.latency_measure), " / ".join(str(a.decisions[d]) for d in DECISIONS)]
         for a in report.arms],
    )  # fmt: skip
    labelled = [a for a in report.arms if a.labels is not None]
    if not labelled:
        return volume + "<p>no labels: quality not measured</p>"
    quality = _table(
        ["arm", "version", "labelled", "units", "AUC [95% CI]",
         "precision@review", "recall@review", "precision@decline", "recall@decline"],
        [[_e(a.arm), _e(a.version), m.labelled, m.entities, _ci(m.auc),
          _ci(m.precision_at_review),
          _ci(m.recall_at_review), _ci(m.precision_at_decline), _ci(m.recall_at_decline)]
         for a in labelled if (m := a.labels) is not None],
    )  # fmt: skip
    return volume + "<h2>Quality against labels</h2>" + quality


def _img(plot: Callable[[Any, Report], None], report: Report) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    plot(figure.add_subplot(), report)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return (
        f'<p><img alt="{_e(plot.__name__.strip("_"))}" src="data:image/png;base64,{encoded}"></p>'
    )


def _label(arm: Any) -> str:
    return f"{arm.arm} {arm.version}"


def _latency_label(arm: Any) -> str:
    return f"{arm.arm} {arm.version}: {arm.latency_measure}"


def _score_plot(ax: Any, report: Report) -> None:
    for arm in report.arms:
        h = arm.score_histogram
        ax.stairs(h.counts, h.edges, label=_label(arm), fill=False, linewidth=1.5)
    if report.thresholds:
        for value in report.thresholds.values():
            ax.axvline(value, color="grey", linestyle=":")
    ax.set(title="Score distribution", xlabel="score", ylabel="records")
    ax.legend()


def _latency_plot(ax: Any, report: Report) -> None:
    for arm in report.arms:
        h = arm.latency_histogram
        ax.stairs(h.counts, h.edges, label=_latency_label(arm), fill=False, linewidth=1.5)
    ax.set_xscale("log")
    measures = {arm.latency_measure for arm in report.arms}
    title = "Latency" if len(measures) == 1 else "Latency (the arms time different things)"
    ax.set(title=title, xlabel="latency (ms, log scale)", ylabel="records")
    ax.legend()


def _roc_plot(ax: Any, report: Report) -> None:
    for arm in report.arms:
        if arm.labels and arm.labels.roc:
            fpr, tpr = zip(*arm.labels.roc, strict=True)
            ax.plot(fpr, tpr, label=f"{_label(arm)} AUC {arm.labels.auc.estimate:.3f}")
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":")
    ax.set(title="ROC", xlabel="false positive rate", ylabel="true positive rate")
    ax.legend()
