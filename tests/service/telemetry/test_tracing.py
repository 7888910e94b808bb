"""Tracing end to end: a real grpc.aio server, the RPC boundary, tail sampling, OTLP receiver."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.environment_variables import OTEL_BSP_MAX_EXPORT_BATCH_SIZE
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from telemetry_echo import call, echo_server

from service.config import Settings
from service.telemetry import SAMPLED_REASON_ATTRIBUTE, setup_telemetry
from service.telemetry.bootstrap import EXPORT_BATCH_SPANS

OTLP_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
OTLP_SERVER_KIND = 2  # SPAN_KIND_SERVER
CALLER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"


# A slow threshold no call here reaches unless it is made slow (`took:`, twice the threshold):
# a loaded machine cannot turn a fast call into a slow one.
SLOW_MS = 60_000.0
TOOK_SLOW = f"took:{2 * SLOW_MS:.0f}".encode()


def _config(**overrides) -> Settings:
    values = {
        "budget_ms": 10.0,
        "trace_slow_ms": SLOW_MS,
        "trace_sample_ratio": 0.0,
        "metrics_port": None,
        "stats_interval_s": 0,
    }
    values.update(overrides)
    return Settings(**values)


def _run(telemetry, requests, metadata=()):
    async def scenario():
        async with echo_server(telemetry) as stub:
            return [await call(stub, request, metadata) for request in requests]

    try:
        return asyncio.run(scenario())
    finally:
        telemetry.shutdown()


def test_slow_and_failing_requests_arrive_with_their_span_tree(otlp_env):
    telemetry = setup_telemetry(_config())
    codes = _run(telemetry, [b"sleep:1", TOOK_SLOW, b"abort", b"raise", b"missing", b"sleep:0"])
    assert codes == [
        grpc.StatusCode.OK,
        grpc.StatusCode.OK,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.OK,
    ]
    traces = otlp_env.traces()
    # Only the slow one and the three failures: ratio 0 drops the fast OK calls.
    assert len(traces) == 4
    reasons = [
        span.attributes[SAMPLED_REASON_ATTRIBUTE]
        for spans in traces.values()
        for span in spans
        if span.parent_span_id == ""
    ]
    assert sorted(reasons) == ["error", "error", "error", "slow"]
    slow_spans = next(spans for spans in traces.values() if len(spans) == 2)
    root = next(s for s in slow_spans if s.parent_span_id == "")
    child = next(s for s in slow_spans if s.parent_span_id != "")
    assert child.parent_span_id == root.span_id
    assert child.name == "work"
    assert child.attributes["ms"] == 2 * SLOW_MS
    assert child.duration_ms == 2 * SLOW_MS  # monotonic stage times convert exactly
    assert root.duration_ms >= child.duration_ms
    assert root.kind == OTLP_SERVER_KIND
    assert root.name == "test.Echo/Call"
    assert root.service_name == "riskserve"
    assert root.attributes["rpc.system"] == "grpc"
    assert root.attributes["rpc.service"] == "test.Echo"
    assert root.attributes["rpc.method"] == "Call"
    assert root.attributes["rpc.grpc.status_code"] == 0
    assert root.attributes["test.command"] == "took"
    assert root.attributes[SAMPLED_REASON_ATTRIBUTE] == "slow"

    failed = [s for spans in traces.values() for s in spans if s.status_code == OTLP_ERROR]
    assert sorted(s.attributes["rpc.grpc.status_code"] for s in failed) == [5, 5, 13]
    assert {s.attributes[SAMPLED_REASON_ATTRIBUTE] for s in failed} == {"error"}


def test_fast_requests_follow_the_ratio_at_its_ends(otlp_env):
    keep_all = setup_telemetry(_config(trace_sample_ratio=1.0))
    _run(keep_all, [b"sleep:0"] * 20)
    roots = [s for s in otlp_env.spans if s.parent_span_id == ""]
    assert len(roots) == 20
    assert {s.attributes[SAMPLED_REASON_ATTRIBUTE] for s in roots} == {"ratio"}
    assert len(otlp_env.spans) == 40  # each with its child span

    keep_none = setup_telemetry(_config(trace_sample_ratio=0.0))
    stats_before = len(otlp_env.spans)
    _run(keep_none, [b"sleep:0"] * 20)
    assert len(otlp_env.spans) == stats_before
    assert keep_none.tracing is not None
    assert keep_none.tracing.stats().dropped_traces == 20
    assert keep_none.tracing.stats().open_traces == 0


def test_caller_sampled_traceparent_is_kept_and_continued(otlp_env):
    telemetry = setup_telemetry(_config())
    sampled = [("traceparent", f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01")]
    unsampled = [("traceparent", f"00-{'1' * 32}-{CALLER_SPAN_ID}-00")]

    async def scenario():
        async with echo_server(telemetry) as stub:
            await call(stub, b"sleep:0", sampled)
            await call(stub, b"sleep:0", unsampled)

    try:
        asyncio.run(scenario())
    finally:
        telemetry.shutdown()
    traces = otlp_env.traces()
    assert list(traces) == [CALLER_TRACE_ID]
    root = next(s for s in traces[CALLER_TRACE_ID] if s.name == "test.Echo/Call")
    assert root.parent_span_id == CALLER_SPAN_ID
    assert root.attributes[SAMPLED_REASON_ATTRIBUTE] == "parent"
    assert len(traces[CALLER_TRACE_ID]) == 2


def test_export_all_sends_every_span(otlp_env):
    telemetry = setup_telemetry(_config(trace_export_all=True))
    _run(telemetry, [b"sleep:0"] * 5)
    assert telemetry.tracing is not None
    assert telemetry.tracing.stats().kept_by_reason == {"all": 5}
    assert len(otlp_env.spans) == 10
    assert all(SAMPLED_REASON_ATTRIBUTE not in s.attributes for s in otlp_env.spans)


class _BatchSizes(SpanExporter):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def export(self, spans) -> SpanExportResult:
        self.sizes.append(len(spans))
        return SpanExportResult.SUCCESS


@pytest.mark.parametrize(("variable", "largest"), [(None, EXPORT_BATCH_SPANS), ("100", 100)])
def test_spans_are_exported_in_small_batches_unless_the_variable_says(
    monkeypatch, variable, largest
):
    if variable is None:
        monkeypatch.delenv(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, raising=False)
    else:
        monkeypatch.setenv(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, variable)
    exporter = _BatchSizes()
    telemetry = setup_telemetry(_config(trace_export_all=True), span_exporters=[exporter])
    _run(telemetry, [b"sleep:0"] * 150)
    assert sum(exporter.sizes) == 300  # each call's server span and its child
    assert max(exporter.sizes) == largest


def test_file_exporter_is_the_default_and_writes_json_lines(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    trace_file = tmp_path / "traces" / "spans.jsonl"
    telemetry = setup_telemetry(_config(trace_file=trace_file))
    _run(telemetry, [TOOK_SLOW, b"abort", b"sleep:0"])
    records = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert len(records) == 3  # slow root + its child, the aborted root
    by_name = {}
    for record in records:
        by_name.setdefault(record["name"], []).append(record)
    child = by_name["work"][0]
    slow_root = next(
        r for r in by_name["test.Echo/Call"] if r["span_id"] == child["parent_span_id"]
    )
    assert slow_root["trace_id"] == child["trace_id"]
    assert len(slow_root["trace_id"]) == 32
    assert slow_root["kind"] == "SERVER"
    assert slow_root["duration_ms"] >= 2 * SLOW_MS
    assert slow_root["end_unix_ns"] > slow_root["start_unix_ns"]
    assert slow_root["attributes"]["riskserve.sampled_reason"] == "slow"
    assert slow_root["status"]["code"] == "UNSET"
    assert child["attributes"] == {"ms": 2 * SLOW_MS}
    aborted = next(r for r in by_name["test.Echo/Call"] if r["status"]["code"] == "ERROR")
    assert aborted["status"]["description"] == "NOT_FOUND"
    assert aborted["attributes"]["rpc.grpc.status_code"] == 5
    assert aborted["parent_span_id"] is None
    assert slow_root["service_name"] == "riskserve"


def test_none_exporter_keeps_no_trace_and_setup_leaves_globals_alone(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    global_provider = trace.get_tracer_provider()
    first = setup_telemetry(_config())
    second = setup_telemetry(_config())
    try:
        assert trace.get_tracer_provider() is global_provider
        assert first.tracing is not None and second.tracing is not None
        assert first.tracing is not second.tracing
        failed = first.tracing.start_request("svc/Method", {})
        assert first.tracing.end_request(failed, 13, "INTERNAL") == "dropped"  # nowhere to go
    finally:
        first.shutdown()
        second.shutdown()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_otlp_protocol_variable_picks_the_exporter(monkeypatch, protocol):
    from service.telemetry.exporters import span_exporters_from_environment

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    (exporter,) = span_exporters_from_environment(None)
    try:
        expected = "grpc" if protocol == "grpc" else "http"
        assert f".proto.{expected}." in type(exporter).__module__
    finally:
        exporter.shutdown()


def test_trace_file_rotates_and_stays_under_its_cap(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    trace_file = tmp_path / "spans.jsonl"
    max_bytes, backups = 8192, 2
    telemetry = setup_telemetry(
        _config(
            trace_file=trace_file,
            trace_file_max_bytes=max_bytes,
            trace_file_backup_count=backups,
            trace_export_all=True,
        )
    )
    # Every call's trace is kept: two spans of about 700 bytes each, some 20 times the cap.
    _run(telemetry, [b"abort"] * 150)
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["spans.jsonl", "spans.jsonl.1", "spans.jsonl.2"]
    sizes = [f.stat().st_size for f in files]
    assert all(size <= max_bytes for size in sizes), sizes
    assert sum(sizes) <= max_bytes * (backups + 1)
    records = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    # Whole lines only, oldest dropped: fewer spans than were written remain, each readable.
    assert records and all(r["name"] == "test.Echo/Call" for r in records)
    assert len(records) < 150


def test_a_start_that_cannot_serve_metrics_leaves_no_export_thread_behind(tmp_path: Path):
    """The metrics port taken: setup fails naming it, and the trace export it had started is
    shut down, not left running for the life of the process."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = {t.ident for t in threading.enumerate()}
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            setup_telemetry(_config(metrics_port=port, trace_file=tmp_path / "traces.jsonl"))
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == []


class _Unanswered(SpanExporter):
    """An exporter whose collector never answers: each export waits until `answer` is set."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.called = threading.Event()

    def export(self, spans) -> SpanExportResult:
        self.called.set()
        self.answer.wait()
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.answer.set()


def test_a_stop_waits_for_an_unanswered_collector_no_longer_than_its_bound():
    """Kept traces get a bounded time to reach the exporter at a stop: the SDK's own wait (30 s)
    is longer than a pod's grace."""
    exporter = _Unanswered()
    telemetry = setup_telemetry(_config(), span_exporters=[exporter])
    tracing = telemetry.tracing
    assert tracing is not None
    failed = tracing.start_request("svc/Method", {})
    assert tracing.end_request(failed, 13, "INTERNAL") == "error"
    try:
        assert tracing.shutdown(timeout_s=0.2) is False  # the export still waits, unanswered
        assert exporter.called.wait(timeout=30)  # the stop asked for the export it left
    finally:
        exporter.answer.set()
        telemetry.shutdown()


def test_a_trace_file_that_cannot_be_written_is_said_once(tmp_path: Path, caplog):
    """A folder the service cannot write (an image's root-owned working folder): the kept
    traces are lost, and a WARNING names the file once, where they went without a word."""
    (tmp_path / "taken").write_text("a file, not a folder")
    telemetry = setup_telemetry(_config(trace_file=tmp_path / "taken" / "traces.jsonl"))
    with caplog.at_level("DEBUG", logger="service.telemetry.jsonl_exporter"):
        _run(telemetry, [b"abort", b"abort", b"abort"])  # kept: failed calls
    said = [r for r in caplog.records if "kept traces not written to" in r.getMessage()]
    assert said and said[0].levelname == "WARNING"
    assert str(tmp_path / "taken" / "traces.jsonl") in said[0].getMessage()
    assert [r.levelname for r in said[1:]] == ["DEBUG"] * (len(said) - 1)
