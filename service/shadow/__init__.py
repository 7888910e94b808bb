"""Shadow-mode and A/B evaluation: routing, off-path challenger scoring, logging, reports."""

from service.shadow.cli import configure_parser, run_shadow_report, shadow_report_main
from service.shadow.dataset import AmbiguousExperiment, read_records
from service.shadow.errors import ExperimentConfigError, LabelsError, NoRecords, ShadowError
from service.shadow.experiment import ExperimentConfig, ExperimentRouter, ModelExperiment, Route
from service.shadow.html import render_html
from service.shadow.job import ShadowJob
from service.shadow.labels import read_labels
from service.shadow.log import ExperimentLog
from service.shadow.record import RECORD_SCHEMA, ExperimentRecord
from service.shadow.report import ArmSummary, Comparison, Report, build_report
from service.shadow.runner import ShadowRunner
from service.shadow.stats import Interval

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
    "read_labels",
    "read_records",
    "render_html",
    "run_shadow_report",
    "shadow_report_main",
]
