"""Tracing with in-process tail sampling, metrics on /metrics, and live latency stats.

Build once in the composition root with `setup_telemetry(settings)`; the RPC
boundary starts and ends a `RequestTrace` per call through `telemetry.tracing`, the batcher
adds a `BatchTrace` per executed batch, and everything records through `telemetry.metrics`.
Call `telemetry.shutdown()` after the server stops. See docs/telemetry.md.
"""

from service.telemetry.bootstrap import Telemetry, setup_telemetry
from service.telemetry.jsonl_exporter import JsonLinesSpanExporter
from service.telemetry.metrics import BATCH_SIZE_BUCKETS, DURATION_BUCKETS_S, Metrics
from service.telemetry.stats import (
    StageStats,
    StatsReporter,
    StatsSnapshot,
    fetch_stats,
    format_stats,
)
from service.telemetry.tracing import (
    BATCH_SPAN_NAME,
    SAMPLED_REASON_ATTRIBUTE,
    BatchTrace,
    RequestTrace,
    TailSamplingPolicy,
    TailSamplingStats,
    Tracing,
    current_request_trace,
    current_trace_id,
)

__all__ = [
    "BATCH_SIZE_BUCKETS",
    "BATCH_SPAN_NAME",
    "DURATION_BUCKETS_S",
    "SAMPLED_REASON_ATTRIBUTE",
    "BatchTrace",
    "JsonLinesSpanExporter",
    "Metrics",
    "RequestTrace",
    "StageStats",
    "StatsReporter",
    "StatsSnapshot",
    "TailSamplingPolicy",
    "TailSamplingStats",
    "Telemetry",
    "Tracing",
    "current_request_trace",
    "current_trace_id",
    "fetch_stats",
    "format_stats",
    "setup_telemetry",
]
