"""Shadow-mode and A/B evaluation: routing, off-path challenger scoring, logging, reports.

The report (`service.shadow.report`: DuckDB, SciPy, Matplotlib) is imported on first use of
one of its names, so the serving process, which only routes, scores and logs, never loads it.
"""

from typing import Any

from service.shadow.errors import ExperimentConfigError, LabelsError, NoRecords, ShadowError
from service.shadow.experiment import ExperimentConfig, ExperimentRouter, ModelExperiment, Route
from service.shadow.job import ShadowJob
from service.shadow.log import ExperimentLog
from service.shadow.record import RECORD_SCHEMA, ExperimentRecord
from service.shadow.runner import ShadowRunner
from service.shadow.storage import AmbiguousExperiment, read_records

_REPORT_NAMES = frozenset(
    {
        "ArmSummary",
        "Comparison",
        "Interval",
        "Report",
        "build_report",
        "configure_parser",
        "render_html",
        "render_summary",
        "run_shadow_report",
        "shadow_report_main",
    }
)

__all__ = [
    "RECORD_SCHEMA",
    "AmbiguousExperiment",
    "ArmSummary",
    "Comparison",
    "ExperimentConfig",
    "ExperimentConfigError",
    "ExperimentLog",
    "ExperimentRecord",
    "ExperimentRouter",
    "Interval",
    "LabelsError",
    "ModelExperiment",
    "NoRecords",
    "Report",
    "Route",
    "ShadowError",
    "ShadowJob",
    "ShadowRunner",
    "build_report",
    "configure_parser",
    "read_records",
    "render_html",
    "render_summary",
    "run_shadow_report",
    "shadow_report_main",
]


def __getattr__(name: str) -> Any:
    if name in _REPORT_NAMES:
        from service.shadow import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
