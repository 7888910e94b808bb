"""Build the tracing and metrics pipelines without touching the global providers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, SynchronousMultiSpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry, start_http_server

from service.telemetry.config import TelemetryConfig
from service.telemetry.exporters import span_exporters_from_environment
from service.telemetry.interceptor import TracingInterceptor
from service.telemetry.metrics import Metrics, histogram_views
from service.telemetry.stats import LiveStats, StatsReporter
from service.telemetry.tail_sampling import TailSamplingPolicy, TailSamplingProcessor

INSTRUMENTATION_NAME = "riskserve"

_logger = logging.getLogger(__name__)


@dataclass
class Telemetry:
    """The running pipelines; call `shutdown()` once when the server stops."""

    config: TelemetryConfig
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    tracer: Tracer
    metrics: Metrics
    live_stats: LiveStats
    # None with trace_export_all (every span goes straight to the exporters).
    tail_sampler: TailSamplingProcessor | None
    # The port /metrics actually listens on (None when disabled).
    metrics_port: int | None
    _metrics_server: WSGIServer | None
    _reporter: StatsReporter | None

    def interceptor(self) -> TracingInterceptor:
        return TracingInterceptor(self.tracer)

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        return f"http://{self.config.metrics_host}:{self.metrics_port}/metrics"

    def shutdown(self) -> None:
        """Flush and export what is buffered, then stop every thread and socket."""
        if self._reporter is not None:
            self._reporter.stop()
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()


def setup_telemetry(
    config: TelemetryConfig,
    *,
    span_exporters: Sequence[SpanExporter] | None = None,
    metric_readers: Sequence[MetricReader] = (),
    id_generator: IdGenerator | None = None,
) -> Telemetry:
    """Tracing (tail-sampled unless trace_export_all) and metrics for one server.

    `span_exporters` replaces the exporters chosen from OTEL_TRACES_EXPORTER, and
    `metric_readers` are added to the Prometheus one (tests, or an OTLP metric reader).
    """
    resource = Resource.create({SERVICE_NAME: config.service_name})
    live = LiveStats(config.stats_window_size)

    registry = CollectorRegistry()
    readers: list[MetricReader] = [*metric_readers]
    if config.metrics_port is not None:
        readers.append(PrometheusMetricReader(registry=registry))
    meter_provider = MeterProvider(
        metric_readers=readers,
        resource=resource,
        views=histogram_views(),
        shutdown_on_exit=False,
    )
    metrics = Metrics(meter_provider.get_meter(INSTRUMENTATION_NAME), live)

    exporters = (
        list(span_exporters)
        if span_exporters is not None
        else span_exporters_from_environment(config.trace_file)
    )
    export = _export_processor(exporters)
    tail_sampler = None
    tracer_provider = TracerProvider(
        sampler=ALWAYS_ON, resource=resource, id_generator=id_generator, shutdown_on_exit=False
    )
    if config.trace_export_all:
        tracer_provider.add_span_processor(export)
    else:
        tail_sampler = TailSamplingProcessor(
            export,
            TailSamplingPolicy(
                slow_threshold_ns=round(config.slow_threshold_ms * 1e6),
                sample_ratio=config.trace_sample_ratio,
                max_open_traces=config.max_open_traces,
                max_spans_per_trace=config.max_spans_per_trace,
                max_pending_batch_traces=config.max_pending_batch_traces,
            ),
            on_decision=metrics.count_trace_decision,
        )
        tracer_provider.add_span_processor(tail_sampler)
    tracer = tracer_provider.get_tracer(INSTRUMENTATION_NAME)

    server, port = None, None
    if config.metrics_port is not None:
        server, _ = start_http_server(config.metrics_port, config.metrics_host, registry=registry)
        port = server.server_port
        _logger.info("metrics on http://%s:%d/metrics", config.metrics_host, port)

    reporter = None
    if config.stats_interval_s is not None:
        reporter = StatsReporter(live, config.stats_interval_s)
        reporter.start()

    return Telemetry(
        config=config,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        tracer=tracer,
        metrics=metrics,
        live_stats=live,
        tail_sampler=tail_sampler,
        metrics_port=port,
        _metrics_server=server,
        _reporter=reporter,
    )


def _export_processor(exporters: Sequence[SpanExporter]) -> SpanProcessor:
    """One BatchSpanProcessor per exporter, behind a single processor."""
    multi = SynchronousMultiSpanProcessor()
    for exporter in exporters:
        multi.add_span_processor(BatchSpanProcessor(exporter))
    return multi
