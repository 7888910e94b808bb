"""Build the tracing and metrics pipelines without touching the global providers."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.environment_variables import OTEL_BSP_MAX_EXPORT_BATCH_SIZE
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, SynchronousMultiSpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry, start_http_server

from service.config import Settings
from service.telemetry.exporters import span_exporters_from_environment
from service.telemetry.metrics import Metrics, histogram_views
from service.telemetry.stats import STATS_WINDOW_SIZE, LiveStats, StatsReporter
from service.telemetry.tracing import TailSamplingPolicy, Tracing

INSTRUMENTATION_NAME = "riskserve"

_logger = logging.getLogger(__name__)


@dataclass
class Telemetry:
    """The running pipelines; call `shutdown()` once when the server stops."""

    settings: Settings
    meter_provider: MeterProvider
    metrics: Metrics
    live_stats: LiveStats
    # None when tracing is off.
    tracing: Tracing | None
    # The port /metrics actually listens on (None when disabled).
    metrics_port: int | None
    _metrics_server: WSGIServer | None
    _reporter: StatsReporter | None

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        return f"http://{self.settings.metrics_host}:{self.metrics_port}/metrics"

    def shutdown(self) -> None:
        """Flush and export what is buffered, then stop every thread and socket."""
        if self._reporter is not None:
            self._reporter.stop()
        if self.tracing is not None:
            self.tracing.shutdown()
        self.meter_provider.shutdown()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()


def setup_telemetry(
    config: Settings,
    *,
    service_name: str = "riskserve",
    span_exporters: Sequence[SpanExporter] | None = None,
    metric_readers: Sequence[MetricReader] = (),
) -> Telemetry:
    """Tracing (tail-sampled unless trace_export_all; none if `config.tracing` is off) and
    metrics for one server.

    `span_exporters` replaces the exporters chosen from OTEL_TRACES_EXPORTER, and
    `metric_readers` are added to the Prometheus one (tests, or an OTLP metric reader).
    """
    resource = Resource.create({SERVICE_NAME: service_name})
    live = LiveStats(STATS_WINDOW_SIZE)

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

    tracing = None
    if config.tracing:
        exporters = (
            list(span_exporters)
            if span_exporters is not None
            else span_exporters_from_environment(
                config.trace_file, config.trace_file_max_bytes, config.trace_file_backup_count
            )
        )
        tracing = Tracing(
            TailSamplingPolicy(
                slow_threshold_ns=round(config.trace_slow_threshold_ms * 1e6),
                sample_ratio=config.trace_sample_ratio,
                export_all=config.trace_export_all,
            ),
            _export_processor(exporters),
            resource,
            InstrumentationScope(INSTRUMENTATION_NAME),
            keeps=bool(exporters),  # with nowhere to export, nothing for an exemplar to name
        )
        metrics.set_trace_decisions_callback(tracing.decisions)

    server, port = None, None
    if config.metrics_port is not None:
        try:
            server, _ = start_http_server(
                config.metrics_port, config.metrics_host, registry=registry
            )
        except OSError as exc:
            # What was started above would outlive the failed start: its export threads.
            if tracing is not None:
                tracing.shutdown()
            meter_provider.shutdown()
            raise OSError(
                exc.errno,
                f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: "
                f"{exc.strerror}; choose another metrics_port (RISKSERVE_METRICS_PORT), or none",
            ) from exc
        port = server.server_port
        _logger.info("metrics on http://%s:%d/metrics", config.metrics_host, port)

    reporter = None
    if config.stats_interval_s:
        reporter = StatsReporter(live, config.stats_interval_s)
        reporter.start()

    return Telemetry(
        settings=config,
        meter_provider=meter_provider,
        metrics=metrics,
        live_stats=live,
        tracing=tracing,
        metrics_port=port,
        _metrics_server=server,
        _reporter=reporter,
    )


# The most spans one export takes, where OTEL_BSP_MAX_EXPORT_BATCH_SIZE does not say (the SDK's
# own default is 512). The exporter's thread holds the GIL while it encodes a batch, and the
# event loop waits for it: 512 spans to JSON lines take about 5 ms here, which showed in the p99
# when every trace was kept (docs/benchmarks.md). Each export ends in I/O, which gives the GIL
# back, so smaller batches keep the loop's waits short; the time spent exporting is the same.
EXPORT_BATCH_SPANS = 64


def _export_processor(exporters: Sequence[SpanExporter]) -> SpanProcessor:
    """One BatchSpanProcessor per exporter, behind a single processor."""
    batch = None if os.environ.get(OTEL_BSP_MAX_EXPORT_BATCH_SIZE) else EXPORT_BATCH_SPANS
    multi = SynchronousMultiSpanProcessor()
    for exporter in exporters:
        multi.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=batch))
    return multi
