"""The service's metric instruments behind a small facade, and the histogram views.

Durations are histograms in seconds (unit "s", as OpenTelemetry's conventions ask); the
Prometheus exporter appends the unit, so `riskserve.request.duration` is scraped as
`riskserve_request_duration_seconds_bucket`. Bucket bounds fit a 10 ms budget.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import Histogram
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

from service.telemetry.stats import LiveStats

# 50 µs .. 50 ms, in seconds.
DURATION_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004,
    0.005, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

REQUEST_DURATION = "riskserve.request.duration"
QUEUE_WAIT_DURATION = "riskserve.queue.wait.duration"
ENGINE_DURATION = "riskserve.engine.duration"
BATCH_SIZE = "riskserve.batch.size"

# Queue depth per (model, version).
QueueDepthCallback = Callable[[], Mapping[tuple[str, str], int]]


def histogram_views() -> list[View]:
    """Explicit bucket bounds for our histograms (the SDK default tops out too coarse)."""
    durations = ExplicitBucketHistogramAggregation(boundaries=DURATION_BUCKETS_S)
    return [
        View(instrument_type=Histogram, instrument_name=name, aggregation=durations)
        for name in (REQUEST_DURATION, QUEUE_WAIT_DURATION, ENGINE_DURATION)
    ] + [
        View(
            instrument_type=Histogram,
            instrument_name=BATCH_SIZE,
            aggregation=ExplicitBucketHistogramAggregation(boundaries=BATCH_SIZE_BUCKETS),
        )
    ]


class Metrics:
    """What the handlers, batcher and shadow path record. Safe to call from any thread.

    Histogram records made while a span is current carry an exemplar with its trace id
    (the SDK's default trace-based exemplar filter).
    """

    def __init__(self, meter: Meter, live: LiveStats) -> None:
        self._live = live
        self._request_s = meter.create_histogram(
            REQUEST_DURATION, unit="s", description="Server-side time of one scoring request."
        )
        self._queue_s = meter.create_histogram(
            QUEUE_WAIT_DURATION, unit="s", description="Time a request waited for its batch."
        )
        self._engine_s = meter.create_histogram(
            ENGINE_DURATION, unit="s", description="Engine time of one executed batch."
        )
        self._batch_size = meter.create_histogram(
            BATCH_SIZE, unit="{request}", description="Requests per executed batch."
        )
        self._requests = meter.create_counter(
            "riskserve.requests", unit="{request}", description="Requests by gRPC status."
        )
        self._fallbacks = meter.create_counter(
            "riskserve.fallbacks", unit="{request}", description="Engine fallbacks by reason."
        )
        self._shed = meter.create_counter(
            "riskserve.shed", unit="{request}", description="Requests refused, by reason."
        )
        self._shadow_drops = meter.create_counter(
            "riskserve.shadow.drops", unit="{request}", description="Shadow copies dropped."
        )
        self._traces = meter.create_counter(
            "riskserve.traces", unit="{trace}", description="Tail-sampling decisions."
        )
        self._depth_lock = threading.Lock()
        self._depth_callback: QueueDepthCallback | None = None
        meter.create_observable_gauge(
            "riskserve.queue.depth",
            callbacks=[self._observe_depth],
            unit="{request}",
            description="Requests waiting per model queue.",
        )

    def observe_request(
        self, model: str, version: str, engine: str, status: str, duration_s: float
    ) -> None:
        """One finished request; `status` is the gRPC status name ('OK', 'NOT_FOUND', ...)."""
        attributes = {"model": model, "version": version, "engine": engine}
        self._request_s.record(duration_s, attributes)
        self._requests.add(1, {**attributes, "status": status})
        self._live.windows["end_to_end"].observe(duration_s)

    def observe_queue_wait(self, model: str, version: str, duration_s: float) -> None:
        self._queue_s.record(duration_s, {"model": model, "version": version})
        self._live.windows["queue"].observe(duration_s)

    def observe_batch(
        self, model: str, version: str, engine: str, batch_size: int, engine_s: float
    ) -> None:
        attributes = {"model": model, "version": version, "engine": engine}
        self._batch_size.record(batch_size, attributes)
        self._engine_s.record(engine_s, attributes)
        self._live.windows["engine"].observe(engine_s)

    def count_fallback(self, model: str, reason: str) -> None:
        self._fallbacks.add(1, {"model": model, "reason": reason})

    def count_shed(self, model: str, reason: str) -> None:
        """`reason`: 'queue_full' or 'deadline'."""
        self._shed.add(1, {"model": model, "reason": reason})

    def count_shadow_drop(self, model: str) -> None:
        self._shadow_drops.add(1, {"model": model})

    def count_trace_decision(self, decision: str) -> None:
        self._traces.add(1, {"decision": decision})

    def set_queue_depth_callback(self, callback: QueueDepthCallback | None) -> None:
        """`callback()` -> {(model, version): depth}, called at each scrape."""
        with self._depth_lock:
            self._depth_callback = callback

    def _observe_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._depth_lock:
            callback = self._depth_callback
        if callback is None:
            return []
        return [
            Observation(depth, {"model": model, "version": version})
            for (model, version), depth in callback().items()
        ]
