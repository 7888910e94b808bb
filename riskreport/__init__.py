"""The shadow report: read an experiment's log, compare its arms, print, write JSON and HTML.

Offline analytics, apart from the server: installed with the `report` extra
(`pip install 'riskserve[report]'`: DuckDB, SciPy, Matplotlib) and run as
`riskserve shadow-report` or `python -m riskreport`. It reads the records the server writes
(`service.shadow.record`); the server never imports this package.
"""

from riskreport.build import (
    ArmSummary,
    Comparison,
    Histogram,
    LabelMetrics,
    Report,
    build_report,
)
from riskreport.cli import configure_parser, run_shadow_report, shadow_report_main
from riskreport.dataset import AmbiguousExperiment
from riskreport.html import render_html
from riskreport.stats import Interval
from riskreport.summary import render_summary

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
