"""Tracing with in-process tail sampling, metrics on /metrics, and live latency stats.

Build once in the composition root with `setup_telemetry(TelemetryConfig(...))`, add
`telemetry.interceptor()` to the grpc.aio server, record through `telemetry.metrics`, and call
`telemetry.shutdown()` after the server stops. See docs/telemetry.md.
"""

from service.telemetry.bootstrap import Telemetry, setup_telemetry
from service.telemetry.config import TelemetryConfig
from service.telemetry.interceptor import TracingInterceptor
from service.telemetry.jsonl_exporter import JsonLinesSpanExporter
from service.telemetry.metrics import BATCH_SIZE_BUCKETS, DURATION_BUCKETS_S, Metrics
from service.telemetry.spans import (
    batch_span,
    current_span_context,
    current_trace_id,
    record_stage_span,
)
from service.telemetry.stats import (
    StageStats,
    StatsReporter,
    StatsSnapshot,
    fetch_stats,
    format_stats,
)
from service.telemetry.tail_sampling import (
    SAMPLED_REASON_ATTRIBUTE,
    TailSamplingPolicy,
    TailSamplingProcessor,
    TailSamplingStats,
)

__all__ = [
    "BATCH_SIZE_BUCKETS",
    "DURATION_BUCKETS_S",
    "SAMPLED_REASON_ATTRIBUTE",
    "JsonLinesSpanExporter",
    "Metrics",
    "StageStats",
    "StatsReporter",
    "StatsSnapshot",
    "TailSamplingPolicy",
    "TailSamplingProcessor",
    "TailSamplingStats",
    "Telemetry",
    "TelemetryConfig",
    "TracingInterceptor",
    "batch_span",
    "current_span_context",
    "current_trace_id",
    "fetch_stats",
    "format_stats",
    "record_stage_span",
    "setup_telemetry",
]
