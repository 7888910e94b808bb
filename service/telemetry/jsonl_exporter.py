"""A span exporter writing one JSON object per line, readable without any collector."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id


class JsonLinesSpanExporter(SpanExporter):
    """Appends each exported span to `path` as one JSON line (see docs/telemetry.md)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_record(span), default=str) + "\n" for span in spans)
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            try:
                if self._file is None:
                    self._path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self._path.open("a", encoding="utf-8")
                self._file.write(lines)
                self._file.flush()
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_record(span: ReadableSpan) -> dict[str, Any]:
    """The JSON-ready form of one ended span."""
    context = span.context
    start_ns = span.start_time or 0
    end_ns = span.end_time or start_ns
    return {
        "trace_id": format_trace_id(context.trace_id) if context else None,
        "span_id": format_span_id(context.span_id) if context else None,
        "parent_span_id": format_span_id(span.parent.span_id) if span.parent else None,
        "parent_is_remote": bool(span.parent and span.parent.is_remote),
        "name": span.name,
        "kind": span.kind.name,
        "start_unix_ns": start_ns,
        "end_unix_ns": end_ns,
        "duration_ms": (end_ns - start_ns) / 1e6,
        "attributes": _attributes(span.attributes),
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "links": [
            {
                "trace_id": format_trace_id(link.context.trace_id),
                "span_id": format_span_id(link.context.span_id),
                "attributes": _attributes(link.attributes),
            }
            for link in span.links
        ],
        "events": [
            {
                "name": event.name,
                "time_unix_ns": event.timestamp,
                "attributes": _attributes(event.attributes),
            }
            for event in span.events
        ],
        "service_name": span.resource.attributes.get("service.name"),
    }


def _attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    if not attributes:
        return {}
    return {
        key: list(value) if isinstance(value, tuple) else value for key, value in attributes.items()
    }
