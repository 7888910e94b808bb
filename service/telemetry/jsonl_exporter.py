"""A span exporter writing one JSON object per line, readable without any collector.

The file is bounded: it is rotated by size the way the standard library's
`logging.handlers.RotatingFileHandler` does (``traces.jsonl`` becomes ``traces.jsonl.1``, the
oldest backup is deleted), so the spans on disk never exceed ``max_bytes * (backup_count + 1)``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id

# Defaults of the file's bounds: 16 MiB a file, 3 backups, 64 MiB of spans at most.
log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_BACKUP_COUNT = 3


class JsonLinesSpanExporter(SpanExporter):
    """Appends each exported span to `path` as one JSON line (see docs/telemetry.md); the file
    rotates at `max_bytes`, keeping `backup_count` older files beside it."""

    def __init__(
        self,
        path: Path,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backup_count: int = DEFAULT_BACKUP_COUNT,
    ) -> None:
        if max_bytes < 1 or backup_count < 1:
            # RotatingFileHandler never rotates with no backups: the file would grow unbounded.
            raise ValueError("max_bytes and backup_count must be at least 1")
        self._path = path
        self._max_bytes = max_bytes
        self._backup_count = backup_count
        self._lock = threading.Lock()
        self._handler: RotatingFileHandler | None = None
        self._closed = False
        self._failed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_to_record(span), default=str) for span in spans]
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            try:
                handler = self._open()
                for line in lines:
                    # The handler's own size check and rotation, line by line; its `emit`
                    # would also flush every line, where one flush per batch will do.
                    record = logging.LogRecord(__name__, logging.INFO, "", 0, line, None, None)
                    if handler.shouldRollover(record):
                        handler.doRollover()
                    if handler.stream is None:
                        handler.stream = handler._open()
                    handler.stream.write(line + "\n")
                handler.flush()
            except OSError as exc:
                # Said once at WARNING (a folder not writable stays so), then at DEBUG.
                log.log(
                    logging.DEBUG if self._failed else logging.WARNING,
                    "kept traces not written to %s: %s",
                    self._path,
                    exc,
                )
                self._failed = True
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _open(self) -> RotatingFileHandler:
        if self._handler is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._handler = RotatingFileHandler(
                self._path,
                maxBytes=self._max_bytes,
                backupCount=self._backup_count,
                encoding="utf-8",
                delay=True,
            )
        return self._handler

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            if self._handler is not None:
                self._handler.close()
                self._handler = None

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
