"""The shadow report: read an experiment's log, compare its arms, print, write JSON and HTML.

The serving process never imports this package (nor DuckDB, SciPy or Matplotlib, which it
uses); `riskserve shadow-report` and offline jobs do.
"""

from service.shadow.report.build import (
    ArmSummary,
    Comparison,
    Histogram,
    LabelMetrics,
    Report,
    build_report,
)
from service.shadow.report.cli import configure_parser, run_shadow_report, shadow_report_main
from service.shadow.report.dataset import AmbiguousExperiment
from service.shadow.report.html import render_html
from service.shadow.report.stats import Interval
from service.shadow.report.summary import render_summary

__all__ = [
    "AmbiguousExperiment",
    "ArmSummary",
    "Comparison",
    "Histogram",
    "Interval",
    "LabelMetrics",
    "Report",
    "build_report",
    "configure_parser",
    "render_html",
    "render_summary",
    "run_shadow_report",
    "shadow_report_main",
]
