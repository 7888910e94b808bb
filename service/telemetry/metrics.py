"""The service's metric instruments behind a small facade, and the histogram views.

Durations are histograms in seconds (unit "s", as OpenTelemetry's conventions ask); the
Prometheus exporter appends the unit, so `riskserve.request.duration` is scraped as
`riskserve_request_duration_seconds_bucket`. Bucket bounds fit a 10 ms budget.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
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

# The label of a model or version that is not loaded (see Metrics.loaded_labels).
UNKNOWN_LABEL = "unknown"
# Every reason a request is shed and (the part before ':') an engine falls back: each loaded
# model shows all of them from the start, at 0, so a rate over them needs no special case.
SHED_REASONS = ("queue_full", "deadline", "concurrency")
FALLBACK_REASONS = (
    "shape_mismatch",
    "engine_error",
    "engine_hung",
    "non_finite_output",
    "engines_unavailable",
)

# Why a call was refused UNAUTHENTICATED: no bearer token, one not accepted, or an mTLS client
# identity not on the allow-list.
AUTH_REFUSAL_REASONS = ("missing_token", "invalid_token", "client_identity")

# Each instrument's attributes, as docs/telemetry.md lists them (`service.telemetry.docs`
# writes that table from these and the instruments `Metrics` creates; a test checks both).
_SHED_NOTE = (
    '`model=""` for a call refused before its model is read (`concurrency`, and `deadline` when '
    "the caller's deadline passed before the call was read)"
)
ATTRIBUTES: dict[str, str] = {
    REQUEST_DURATION: "method, model, version, engine",
    QUEUE_WAIT_DURATION: "model, version",
    ENGINE_DURATION: "model, version, engine",
    BATCH_SIZE: "model, version, engine",
    "riskserve.requests": (
        'method, model, version, engine, status (gRPC code name); `model="unknown"` for a '
        "scoring call refused before its model was read (malformed, none named)"
    ),
    "riskserve.fallbacks": f"model, reason ({', '.join(f'`{r}`' for r in FALLBACK_REASONS)})",
    "riskserve.shed": f"model, reason ({', '.join(f'`{r}`' for r in SHED_REASONS)}); {_SHED_NOTE}",
    "riskserve.shadow.drops": "model",
    "riskserve.shadow.sampled_share": "none (one per process)",
    "riskserve.auth.refused": (
        f"method, reason ({', '.join(f'`{r}`' for r in AUTH_REFUSAL_REASONS)})"
    ),
    "riskserve.model.reloads": "model, outcome (`loaded`, `replaced`, `refused`)",
    "riskserve.traces": "decision",
    "riskserve.queue.depth": "model, version",
}

# Queue depth per (model, version).
QueueDepthCallback = Callable[[], Mapping[tuple[str, str], int]]
# Traces decided so far, by reason kept or 'dropped'.
TraceDecisionsCallback = Callable[[], Mapping[str, int]]

_NO_CONTEXT = Context()


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


def _exemplar(kept_trace: trace.SpanContext | None) -> Context:
    """The context a request's histogram record carries: its span where its trace was kept."""
    if kept_trace is None:
        return _NO_CONTEXT
    return trace.set_span_in_context(trace.NonRecordingSpan(kept_trace))


class Metrics:
    """What the handlers, batcher and shadow path record. Safe to call from any thread.

    A request's duration carries an exemplar with its trace id when its trace was kept (the
    SDK's trace-based exemplar filter, given the kept span), so an exemplar always names a
    trace that was exported. Counts that change on every request are plain integers read by
    asynchronous counters at collection time: an SDK counter's `add` costs about 8 µs here.
    """

    def __init__(self, meter: Meter, live: LiveStats) -> None:
        self._live = live
        self._request_s = meter.create_histogram(
            REQUEST_DURATION, unit="s", description="Server-side time of one scoring request."
        )
        self._queue_s = meter.create_histogram(
            QUEUE_WAIT_DURATION,
            unit="s",
            description="Longest time a request of each executed batch waited for it.",
        )
        self._engine_s = meter.create_histogram(
            ENGINE_DURATION, unit="s", description="Engine time of one executed batch."
        )
        self._batch_size = meter.create_histogram(
            BATCH_SIZE, unit="{row}", description="Rows per executed batch."
        )
        self._counts_lock = threading.Lock()
        self._request_counts: dict[tuple[str, str, str, str, str], int] = {}
        self._fallback_counts: dict[tuple[str, str], int] = {}
        self._shed_counts: dict[tuple[str, str], int] = {}
        self._shadow_drop_counts: dict[str, int] = {}
        self._auth_refusal_counts: dict[tuple[str, str], int] = {}
        meter.create_observable_counter(
            "riskserve.requests",
            callbacks=[self._observe_requests],
            unit="{request}",
            description="Requests by RPC method and gRPC status.",
        )
        meter.create_observable_counter(
            "riskserve.fallbacks",
            callbacks=[self._observe_fallbacks],
            unit="{batch}",
            description="Executed batches that fell back, wholly or in part, by reason.",
        )
        meter.create_observable_counter(
            "riskserve.shed",
            callbacks=[self._observe_shed],
            unit="{request}",
            description="Requests refused, by reason.",
        )
        meter.create_observable_counter(
            "riskserve.shadow.drops",
            callbacks=[self._observe_shadow_drops],
            unit="{request}",
            description="Shadow copies dropped.",
        )
        meter.create_observable_counter(
            "riskserve.auth.refused",
            callbacks=[self._observe_auth_refusals],
            unit="{call}",
            description="Calls refused UNAUTHENTICATED, by RPC method and reason.",
        )
        self._model_reloads = meter.create_counter(
            "riskserve.model.reloads",
            unit="{version}",
            description="Hot reloads of model versions by outcome (loaded, replaced, refused).",
        )
        self._callback_lock = threading.Lock()
        self._depth_callback: QueueDepthCallback | None = None
        self._decisions_callback: TraceDecisionsCallback | None = None
        self._shadow_share_callback: Callable[[], float] | None = None
        meter.create_observable_gauge(
            "riskserve.shadow.sampled_share",
            callbacks=[self._observe_shadow_share],
            description="Share of entities the shadow worker scores: 1, or less while it is "
            "behind (a deterministic sample by entity hash).",
        )
        meter.create_observable_counter(
            "riskserve.traces",
            callbacks=[self._observe_decisions],
            unit="{trace}",
            description="Tail-sampling decisions.",
        )
        meter.create_observable_gauge(
            "riskserve.queue.depth",
            callbacks=[self._observe_depth],
            unit="{request}",
            description="Requests waiting per model queue.",
        )

    def observe_request(
        self,
        model: str,
        version: str,
        engine: str,
        status: str,
        duration_s: float,
        kept_trace: trace.SpanContext | None = None,
        method: str = "",
    ) -> None:
        """One finished request; `status` is the gRPC status name ('OK', 'NOT_FOUND', ...),
        `method` the RPC's ('Score', 'ModelInfer', ...).

        `kept_trace` is the request's span where its trace was exported (the exemplar).
        """
        attributes = {"method": method, "model": model, "version": version, "engine": engine}
        self._request_s.record(duration_s, attributes, _exemplar(kept_trace))
        self._count_requests((method, model, version, engine, status), 1)
        self._live.windows["end_to_end"].observe(duration_s)

    def observe_requests(
        self,
        model: str,
        version: str,
        engine: str,
        status: str,
        durations_s: Sequence[float],
        kept_traces: Sequence[trace.SpanContext | None],
        method: str,
    ) -> None:
        """Finished requests of one method, model, engine and status at once (the messages of
        a stream scored together): `observe_request` for each, one count and lock for all."""
        attributes = {"method": method, "model": model, "version": version, "engine": engine}
        record, window = self._request_s.record, self._live.windows["end_to_end"]
        for duration_s, kept in zip(durations_s, kept_traces, strict=True):
            record(duration_s, attributes, _exemplar(kept))
            window.observe(duration_s)
        self._count_requests((method, model, version, engine, status), len(durations_s))

    def _count_requests(self, key: tuple[str, str, str, str, str], n: int) -> None:
        with self._counts_lock:
            self._request_counts[key] = self._request_counts.get(key, 0) + n

    def observe_queue_waits(self, model: str, version: str, durations_s: list[float]) -> None:
        """How long each request of one executed batch waited for it.

        The histogram takes the longest wait, once a batch: an SDK record costs tens of
        microseconds, and the head of the queue is what the deadlines see. The live window
        (a plain ring buffer) keeps every request's wait.
        """
        if not durations_s:
            return
        window = self._live.windows["queue"]
        for duration_s in durations_s:
            window.observe(duration_s)
        attributes = {"model": model, "version": version}
        self._queue_s.record(max(durations_s), attributes, _NO_CONTEXT)

    def observe_batch(
        self, model: str, version: str, engine: str, batch_size: int, engine_s: float
    ) -> None:
        attributes = {"model": model, "version": version, "engine": engine}
        self._batch_size.record(batch_size, attributes, _NO_CONTEXT)
        self._engine_s.record(engine_s, attributes, _NO_CONTEXT)
        self._live.windows["engine"].observe(engine_s)

    def count_fallback(self, model: str, reason: str) -> None:
        """`reason`: one of FALLBACK_REASONS."""
        with self._counts_lock:
            key = (model, reason)
            self._fallback_counts[key] = self._fallback_counts.get(key, 0) + 1

    def count_shed(self, model: str, reason: str, requests: int = 1) -> None:
        """`requests` refused for `reason`, one of SHED_REASONS (stream messages queued as one
        job are refused together, and each counts)."""
        with self._counts_lock:
            key = (model, reason)
            self._shed_counts[key] = self._shed_counts.get(key, 0) + requests

    def count_shadow_drop(self, model: str, copies: int = 1) -> None:
        """`copies` shadow copies of `model`'s requests were dropped."""
        with self._counts_lock:
            self._shadow_drop_counts[model] = self._shadow_drop_counts.get(model, 0) + copies

    def count_auth_refused(self, method: str, reason: str) -> None:
        """A call to `method` (a registered RPC's name, so the labels stay bounded) was refused
        for `reason`, one of AUTH_REFUSAL_REASONS."""
        with self._counts_lock:
            key = (method, reason)
            self._auth_refusal_counts[key] = self._auth_refusal_counts.get(key, 0) + 1

    def loaded_labels(self, model: str, version: str) -> tuple[str, str]:
        """`model` and `version` as metric labels: kept where loaded, else UNKNOWN_LABEL.

        A caller can name any model; labelling its requests with that name would let it make
        series without bound. The loaded versions are the keys of the queue-depth callback.
        """
        with self._callback_lock:
            callback = self._depth_callback
        loaded = callback() if callback is not None else {}
        if (model, version) in loaded:
            return model, version
        if any(name == model for name, _ in loaded):
            return model, "" if not version else UNKNOWN_LABEL
        return UNKNOWN_LABEL, "" if not version else UNKNOWN_LABEL

    def count_model_reload(self, model: str, outcome: str) -> None:
        """`outcome`: 'loaded' (a new version), 'replaced' (changed files) or 'refused'."""
        self._model_reloads.add(1, {"model": model, "outcome": outcome})

    def set_queue_depth_callback(self, callback: QueueDepthCallback | None) -> None:
        """`callback()` -> {(model, version): depth} of every loaded version, called at each
        scrape and to check a failed request's labels (`loaded_labels`)."""
        with self._callback_lock:
            self._depth_callback = callback

    def set_shadow_share_callback(self, callback: Callable[[], float] | None) -> None:
        """`callback()` -> the shadow worker's sampled share, read at each scrape."""
        with self._callback_lock:
            self._shadow_share_callback = callback

    def set_trace_decisions_callback(self, callback: TraceDecisionsCallback | None) -> None:
        """`callback()` -> {decision: traces so far}, called at each scrape."""
        with self._callback_lock:
            self._decisions_callback = callback

    def _observe_requests(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._counts_lock:
            counts = dict(self._request_counts)
        return [
            Observation(n, {"method": k, "model": m, "version": v, "engine": e, "status": s})
            for (k, m, v, e, s), n in counts.items()
        ]

    def _loaded_models(self) -> set[str]:
        with self._callback_lock:
            callback = self._depth_callback
        return {model for model, _ in callback()} if callback is not None else set()

    def _by_reason(
        self, counts: dict[tuple[str, str], int], reasons: tuple[str, ...]
    ) -> list[Observation]:
        """Counts by (model, reason), with every known reason of every loaded model at 0."""
        loaded = self._loaded_models()
        with self._counts_lock:
            totals = dict.fromkeys(((m, r) for m in loaded for r in reasons), 0) | counts
        return [Observation(n, {"model": m, "reason": r}) for (m, r), n in totals.items()]

    def _observe_fallbacks(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._by_reason(self._fallback_counts, FALLBACK_REASONS)

    def _observe_shed(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._by_reason(self._shed_counts, SHED_REASONS)

    def _observe_shadow_drops(self, options: CallbackOptions) -> Iterable[Observation]:
        loaded = self._loaded_models()
        with self._counts_lock:
            totals = dict.fromkeys(loaded, 0) | self._shadow_drop_counts
        return [Observation(n, {"model": m}) for m, n in totals.items()]

    def _observe_auth_refusals(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._counts_lock:
            counts = dict(self._auth_refusal_counts)
        return [Observation(n, {"method": m, "reason": r}) for (m, r), n in counts.items()]

    def _observe_decisions(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._callback_lock:
            callback = self._decisions_callback
        if callback is None:
            return []
        return [Observation(n, {"decision": d}) for d, n in dict(callback()).items()]

    def _observe_shadow_share(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._callback_lock:
            callback = self._shadow_share_callback
        return [] if callback is None else [Observation(callback())]

    def _observe_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._callback_lock:
            callback = self._depth_callback
        if callback is None:
            return []
        return [
            Observation(depth, {"model": model, "version": version})
            for (model, version), depth in callback().items()
        ]
