"""Telemetry settings as one frozen value; the composition root builds it from Settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service.telemetry.jsonl_exporter import DEFAULT_BACKUP_COUNT, DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class TelemetryConfig:
    """What to trace, what to keep, and where metrics are served.

    The trace exporter itself is chosen by the standard ``OTEL_TRACES_EXPORTER`` variable
    (``otlp``, ``console``, ``none``; unset: the JSON-lines file below) and the OTLP exporters
    read ``OTEL_EXPORTER_OTLP_*`` themselves.
    """

    service_name: str = "riskserve"
    budget_ms: float = 10.0
    # Traces whose local root lasts at least this long are always kept (None: budget / 2).
    trace_slow_ms: float | None = None
    # Share of the other (fast, OK, caller-unsampled) traces kept, decided on the trace id.
    trace_sample_ratio: float = 0.01
    # Trace requests and batches at all.
    tracing: bool = True
    # Export every span and leave sampling to a Collector's tail sampler.
    trace_export_all: bool = False
    # JSON-lines span file used when OTEL_TRACES_EXPORTER is unset (None: no default exporter).
    trace_file: Path | None = Path("traces.jsonl")
    # The file rotates at this size; this many older files are kept (traces.jsonl.1, ...).
    trace_file_max_bytes: int = DEFAULT_MAX_BYTES
    trace_file_backup_count: int = DEFAULT_BACKUP_COUNT
    metrics_host: str = "127.0.0.1"
    # Prometheus /metrics port; 0 picks a free port (see Telemetry.metrics_port); None disables.
    metrics_port: int | None = 9464
    # Period of the live p50/p99 log line; None disables the reporter.
    stats_interval_s: float | None = 10.0
    # Observations kept per stage for the live percentiles.
    stats_window_size: int = 4096

    def __post_init__(self) -> None:
        if self.budget_ms <= 0:
            raise ValueError("budget_ms must be positive")
        if self.trace_slow_ms is not None and self.trace_slow_ms < 0:
            raise ValueError("trace_slow_ms must not be negative")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError("trace_sample_ratio must lie in [0, 1]")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must lie in [0, 65535]")
        if self.trace_file_max_bytes < 1 or self.trace_file_backup_count < 1:
            raise ValueError("trace_file_max_bytes and trace_file_backup_count must be >= 1")
        if self.stats_interval_s is not None and self.stats_interval_s <= 0:
            raise ValueError("stats_interval_s must be positive")
        if self.stats_window_size < 1:
            raise ValueError("stats_window_size must be at least 1")

    @property
    def slow_threshold_ms(self) -> float:
        """The effective slow-trace threshold."""
        return self.budget_ms / 2 if self.trace_slow_ms is None else self.trace_slow_ms
