"""Metrics: the Prometheus endpoint over real HTTP, bucket bounds, exemplars, queue depth."""

from __future__ import annotations

import asyncio
import urllib.request

from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricsData,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from telemetry_echo import call, echo_server

from service.config import Settings
from service.telemetry import DURATION_BUCKETS_S, setup_telemetry
from service.telemetry.stats import stats_from_scrapes


def _config(**overrides) -> Settings:
    values = {"metrics_port": 0, "stats_interval_s": 0, "trace_file": None}
    values.update(overrides)
    return Settings(**values)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        return response.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples, name: str, **labels: str) -> float:
    matches = [
        v for (n, lbl), v in samples.items() if n == name and labels.items() <= dict(lbl).items()
    ]
    assert matches, f"no sample {name} {labels}"
    return sum(matches)


def test_prometheus_endpoint_shows_histograms_with_the_right_counts(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    telemetry = setup_telemetry(_config())
    try:
        assert telemetry.metrics_port not in (None, 0)
        metrics = telemetry.metrics
        for duration_s in (0.0002, 0.0004, 0.0031, 0.012, 0.2):
            metrics.observe_request("fraud-demo", "1", "onnxruntime-cpu", "OK", duration_s)
        metrics.observe_request("fraud-demo", "1", "none", "RESOURCE_EXHAUSTED", 0.00001)
        metrics.observe_queue_waits("fraud-demo", "1", [0.0007])
        metrics.observe_batch("fraud-demo", "1", "onnxruntime-cpu", 5, 0.0021)
        metrics.count_fallback("fraud-demo", "shape_mismatch")
        metrics.count_shed("fraud-demo", "queue_full")
        metrics.count_shed("fraud-demo", "deadline")
        metrics.count_shed("fraud-demo", "deadline")
        metrics.count_shadow_drop("fraud-demo")
        metrics.set_queue_depth_callback(lambda: {("fraud-demo", "1"): 7})
        samples = _samples(_scrape(telemetry.metrics_url))
    finally:
        telemetry.shutdown()

    request = "riskserve_request_duration_seconds"
    engine = {"model": "fraud-demo", "version": "1", "engine": "onnxruntime-cpu"}
    assert _value(samples, f"{request}_count", **engine) == 5
    assert _value(samples, f"{request}_bucket", le="0.00025", **engine) == 1
    assert _value(samples, f"{request}_bucket", le="0.0005", **engine) == 2
    assert _value(samples, f"{request}_bucket", le="0.004", **engine) == 3
    assert _value(samples, f"{request}_bucket", le="0.05", **engine) == 4
    assert _value(samples, f"{request}_bucket", le="+Inf", **engine) == 5
    bounds = sorted(
        float(dict(lbl)["le"])
        for (n, lbl), _ in samples.items()
        if n == f"{request}_bucket" and dict(lbl).get("engine") == "onnxruntime-cpu"
    )
    assert bounds[:-1] == list(DURATION_BUCKETS_S)
    assert _value(samples, "riskserve_requests_total", status="OK") == 5
    assert _value(samples, "riskserve_requests_total", status="RESOURCE_EXHAUSTED") == 1
    assert _value(samples, "riskserve_queue_wait_duration_seconds_count", model="fraud-demo") == 1
    assert _value(samples, "riskserve_engine_duration_seconds_bucket", le="0.003", **engine) == 1
    assert _value(samples, "riskserve_batch_size_bucket", le="4", **engine) == 0
    assert _value(samples, "riskserve_batch_size_bucket", le="8", **engine) == 1
    assert _value(samples, "riskserve_fallbacks_total", reason="shape_mismatch") == 1
    assert _value(samples, "riskserve_shed_total", reason="deadline") == 2
    assert _value(samples, "riskserve_shed_total", reason="queue_full") == 1
    assert _value(samples, "riskserve_shadow_drops_total", model="fraud-demo") == 1
    assert _value(samples, "riskserve_queue_depth", model="fraud-demo", version="1") == 7


def test_requests_through_the_boundary_are_counted_and_exemplars_name_kept_traces():
    reader = InMemoryMetricReader()
    exported = InMemorySpanExporter()
    telemetry = setup_telemetry(
        # Slow from a minute: only the call made to take two minutes (at once) is slow.
        _config(trace_sample_ratio=0.0, trace_slow_ms=60_000.0),
        span_exporters=[exported],
        metric_readers=[reader],
    )

    async def scenario():
        async with echo_server(telemetry) as stub:
            for request in (b"sleep:0", b"sleep:0", b"took:120000", b"abort"):
                await call(stub, request)

    try:
        before = _scrape(telemetry.metrics_url)
        asyncio.run(scenario())
        after = _scrape(telemetry.metrics_url)
        data = reader.get_metrics_data()
    finally:
        telemetry.shutdown()

    samples = _samples(after)
    assert _value(samples, "riskserve_requests_total", status="OK") == 3
    assert _value(samples, "riskserve_requests_total", status="NOT_FOUND") == 1
    assert _value(samples, "riskserve_traces_total", decision="dropped") == 2
    assert _value(samples, "riskserve_traces_total", decision="error") == 1
    assert _value(samples, "riskserve_traces_total", decision="slow") == 1

    points = _duration_points(data)
    assert all(isinstance(p, HistogramDataPoint) for p in points)
    exemplars = [e for p in points for e in p.exemplars]
    # Only the two kept traces (slow, aborted) are offered as exemplars, never a dropped one,
    # and each names a trace that was exported.
    assert len(exemplars) == 2
    spans = {(s.context.trace_id, s.context.span_id) for s in exported.get_finished_spans()}
    assert {(e.trace_id, e.span_id) for e in exemplars} <= spans

    snapshot = stats_from_scrapes(before, after, window_s=1.0)
    end_to_end = snapshot.stages[0]
    assert end_to_end.stage == "end_to_end"
    assert end_to_end.count == 4
    assert 0 < end_to_end.p50_ms <= end_to_end.p99_ms


def test_metrics_can_be_disabled():
    telemetry = setup_telemetry(_config(metrics_port=None))
    try:
        assert telemetry.metrics_port is None
        assert telemetry.metrics_url is None
        telemetry.metrics.observe_request("m", "1", "e", "OK", 0.001)
    finally:
        telemetry.shutdown()


def test_without_a_trace_exporter_no_trace_is_kept_nor_named_by_an_exemplar(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(_config(trace_sample_ratio=1.0), metric_readers=[reader])

    async def scenario():
        async with echo_server(telemetry) as stub:
            for request in (b"sleep:0", b"abort"):
                await call(stub, request)

    try:
        asyncio.run(scenario())
        data = reader.get_metrics_data()
    finally:
        telemetry.shutdown()
    assert [e for p in _duration_points(data) for e in p.exemplars] == []


def _duration_points(data: MetricsData) -> list:
    """The request-duration histogram's points that an in-memory reader collected."""
    return [
        point
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "riskserve.request.duration"
        for point in metric.data.data_points
    ]
