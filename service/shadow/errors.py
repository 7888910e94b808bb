"""Errors of the shadow / A-B package.

Exception tree::

    ShadowError
    ├── ExperimentConfigError  an experiment configuration is invalid or unreadable
    ├── NoRecords              no experiment record matched the report's selection
    └── LabelsError            a labels file lacks the columns a join needs
"""

from __future__ import annotations

__all__ = ["ExperimentConfigError", "LabelsError", "NoRecords", "ShadowError"]


class ShadowError(Exception):
    """Base of every error this package raises."""


class ExperimentConfigError(ShadowError):
    """An experiment configuration is invalid or cannot be read."""


class NoRecords(ShadowError):
    """No experiment record matched the prefix, experiment and time window asked for."""


class LabelsError(ShadowError):
    """A labels file cannot be joined to the records."""
