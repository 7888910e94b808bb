"""Choose the span exporters the way the SDK's auto-configuration does.

``OTEL_TRACES_EXPORTER`` names entry points (``otlp``, ``otlp_proto_grpc``, ``otlp_proto_http``,
``console``, ``none``); ``otlp`` follows ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``. The SDK's own
(private) helpers resolve the names and load the classes, and each OTLP exporter reads its
endpoint, headers and timeout from ``OTEL_EXPORTER_OTLP_*`` when constructed.
"""

from __future__ import annotations

import os
from pathlib import Path

from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
from opentelemetry.sdk._configuration import _get_exporter_names, _import_exporters
from opentelemetry.sdk.trace.export import SpanExporter

from service.telemetry.jsonl_exporter import (
    DEFAULT_BACKUP_COUNT,
    DEFAULT_MAX_BYTES,
    JsonLinesSpanExporter,
)


def span_exporters_from_environment(
    trace_file: Path | None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    backup_count: int = DEFAULT_BACKUP_COUNT,
) -> list[SpanExporter]:
    """The exporters OTEL_TRACES_EXPORTER asks for; unset: the JSON-lines file, if any,
    rotated at `max_bytes` with `backup_count` older files kept."""
    if OTEL_TRACES_EXPORTER not in os.environ:
        if trace_file is None:
            return []
        return [JsonLinesSpanExporter(trace_file, max_bytes, backup_count)]
    names = _get_exporter_names("traces")
    trace_exporters, _, _ = _import_exporters(names, [], [])
    return [exporter_class() for exporter_class in trace_exporters.values()]
