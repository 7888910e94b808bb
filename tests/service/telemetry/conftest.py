"""A real OTLP/gRPC trace receiver on 127.0.0.1:0, and helpers shared by the telemetry tests."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

# The telemetry tests share helpers (telemetry_echo) that live beside them.
sys.path.insert(0, str(Path(__file__).parent))


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    attributes: dict[str, object]
    status_code: int
    duration_ms: float
    links: tuple[tuple[str, str], ...]
    service_name: str


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self._changed = threading.Condition()

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=span.kind,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            status_code=span.status.code,
                            duration_ms=(span.end_time_unix_nano - span.start_time_unix_nano) / 1e6,
                            links=tuple((ln.trace_id.hex(), ln.span_id.hex()) for ln in span.links),
                            service_name=str(resource.get("service.name")),
                        )
                    )
        with self._changed:
            self.spans.extend(received)
            self.exports += 1
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 5.0
    ) -> list[ReceivedSpan]:
        deadline_s = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(self.spans):
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    raise AssertionError(f"receiver saw only {len(self.spans)} spans")
                self._changed.wait(remaining_s)
            return list(self.spans)


@dataclass(frozen=True)
class OtlpReceiver:
    endpoint: str
    collector: _Collector

    @property
    def spans(self) -> list[ReceivedSpan]:
        return list(self.collector.spans)

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        by_trace: dict[str, list[ReceivedSpan]] = {}
        for span in self.collector.spans:
            by_trace.setdefault(span.trace_id, []).append(span)
        return by_trace

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 5.0
    ) -> list[ReceivedSpan]:
        return self.collector.wait_for(predicate, timeout_s)


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """An OTLP TraceService on 127.0.0.1:0 that keeps every span it is sent."""
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield OtlpReceiver(endpoint=f"http://127.0.0.1:{port}", collector=collector)
    finally:
        server.stop(None).wait()


@pytest.fixture
def otlp_env(otlp_receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> OtlpReceiver:
    """Point the standard OTEL_* variables at the receiver (OTLP over gRPC, insecure)."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    return otlp_receiver
