"""Shadow-mode and A/B evaluation on the serving side: routing, off-path challenger scoring, logs.

The report that compares the arms from the log is the separate `riskreport` package (with the
`report` extra: DuckDB, SciPy, Matplotlib). It imports the record schema from here; nothing here
imports it, so the serving process never loads it.
"""

from service.shadow.errors import ExperimentConfigError, LabelsError, NoRecords, ShadowError
from service.shadow.experiment import ExperimentConfig, ExperimentRouter, ModelExperiment, Route
from service.shadow.job import ShadowJob
from service.shadow.log import ExperimentLog
from service.shadow.record import RECORD_SCHEMA, ExperimentRecord
from service.shadow.runner import ShadowRunner
from service.shadow.storage import AmbiguousExperiment, read_records

__all__ = [
    "RECORD_SCHEMA",
    "AmbiguousExperiment",
    "ExperimentConfig",
    "ExperimentConfigError",
    "ExperimentLog",
    "ExperimentRecord",
    "ExperimentRouter",
    "LabelsError",
    "ModelExperiment",
    "NoRecords",
    "Route",
    "ShadowError",
    "ShadowJob",
    "ShadowRunner",
    "read_records",
]
