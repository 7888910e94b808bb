"""Live latency percentiles per stage: in process (a bounded window) or from /metrics buckets."""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

STAGES = ("end_to_end", "queue", "engine")
# Prometheus histogram family of each stage (OTel name, unit suffix added by the exporter).
STAGE_FAMILIES = {
    "end_to_end": "riskserve_request_duration_seconds",
    "queue": "riskserve_queue_wait_duration_seconds",
    "engine": "riskserve_engine_duration_seconds",
}

_logger = logging.getLogger("riskserve.stats")


@dataclass(frozen=True)
class StageStats:
    """Percentiles of one stage over a window; NaN when the window saw nothing."""

    stage: str
    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float


@dataclass(frozen=True)
class StatsSnapshot:
    window_s: float
    stages: tuple[StageStats, ...]


class LatencyWindow:
    """The last `size` observations of one stage (a ring), thread-safe."""

    def __init__(self, size: int) -> None:
        self._values_s = [0.0] * size
        self._size = size
        self._next = 0
        self._lock = threading.Lock()

    def observe(self, duration_s: float) -> None:
        with self._lock:
            self._values_s[self._next % self._size] = duration_s
            self._next += 1

    def drain(self) -> tuple[int, list[float]]:
        """(observations since the last drain, up to `size` of the newest), then reset."""
        with self._lock:
            count = self._next
            values = self._values_s[: min(count, self._size)]
            self._next = 0
        return count, values


# Observations kept per stage for the live percentiles.
STATS_WINDOW_SIZE = 4096


class LiveStats:
    """One window per stage; `snapshot()` reports and resets them."""

    def __init__(self, window_size: int) -> None:
        self.windows = {stage: LatencyWindow(window_size) for stage in STAGES}
        self._since_s = time.monotonic()

    def snapshot(self) -> StatsSnapshot:
        now_s = time.monotonic()
        window_s, self._since_s = now_s - self._since_s, now_s
        stages = []
        for stage, window in self.windows.items():
            count, values_s = window.drain()
            stages.append(_stage_from_values(stage, count, values_s))
        return StatsSnapshot(window_s=window_s, stages=tuple(stages))


def _stage_from_values(stage: str, count: int, values_s: Sequence[float]) -> StageStats:
    if not values_s:
        return StageStats(stage, 0, float("nan"), float("nan"), float("nan"))
    p50_s, p99_s = np.percentile(values_s, [50, 99])
    return StageStats(stage, count, p50_s * 1e3, p99_s * 1e3, max(values_s) * 1e3)


NO_REQUESTS = "no requests in the window"


def format_stats(snapshot: StatsSnapshot) -> str:
    """One line per stage, e.g. for `riskserve stats` or a log line; a window that saw no
    request says so in one line instead of percentiles of nothing."""
    header = f"window {snapshot.window_s:.1f} s"
    if not any(stage.count for stage in snapshot.stages):
        return f"{header}: {NO_REQUESTS}"
    lines = [header]
    for stage in snapshot.stages:
        if not stage.count:
            lines.append(f"{stage.stage:<10} n=0       none in the window")
            continue
        lines.append(
            f"{stage.stage:<10} n={stage.count:<7d} p50={stage.p50_ms:8.3f} ms "
            f"p99={stage.p99_ms:8.3f} ms max={stage.max_ms:8.3f} ms"
        )
    return "\n".join(lines)


class StatsReporter:
    """Logs `format_stats` of a LiveStats every `interval_s` on a daemon thread."""

    def __init__(self, stats: LiveStats, interval_s: float, logger: logging.Logger = _logger):
        self._stats = stats
        self._interval_s = interval_s
        self._logger = logger
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="riskserve-stats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            line = format_stats(self._stats.snapshot()).replace("\n", " | ")
            self._logger.info("latency %s", line)


# -- from a Prometheus scrape (the `riskserve stats` CLI) -------------------------------------


@dataclass(frozen=True)
class _Buckets:
    upper_bounds_s: tuple[float, ...]
    cumulative: tuple[float, ...]


def parse_stage_buckets(metrics_text: str) -> dict[str, _Buckets]:
    """Cumulative bucket counts per stage, summed over all label sets."""
    family_to_stage = {family: stage for stage, family in STAGE_FAMILIES.items()}
    sums: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        stage = family_to_stage.get(family.name) or family_to_stage.get(family.name + "_seconds")
        if stage is None:
            continue
        per_bound = sums.setdefault(stage, {})
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                per_bound[bound] = per_bound.get(bound, 0.0) + sample.value
    return {
        stage: _Buckets(tuple(sorted(per_bound)), tuple(per_bound[b] for b in sorted(per_bound)))
        for stage, per_bound in sums.items()
    }


def stats_from_scrapes(before: str, after: str, window_s: float) -> StatsSnapshot:
    """Percentiles of what happened between two scrapes of /metrics (bucket interpolation)."""
    old, new = parse_stage_buckets(before), parse_stage_buckets(after)
    stages = []
    for stage in STAGES:
        buckets = new.get(stage)
        if buckets is None:
            stages.append(_stage_from_values(stage, 0, ()))
            continue
        previous = old.get(stage)
        counts = np.array(buckets.cumulative)
        if previous is not None and previous.upper_bounds_s == buckets.upper_bounds_s:
            counts = counts - np.array(previous.cumulative)
        stages.append(_stage_from_buckets(stage, buckets.upper_bounds_s, counts))
    return StatsSnapshot(window_s=window_s, stages=tuple(stages))


def _stage_from_buckets(
    stage: str, upper_bounds_s: Sequence[float], cumulative: np.ndarray
) -> StageStats:
    total = int(cumulative[-1]) if len(cumulative) else 0
    if total == 0:
        return _stage_from_values(stage, 0, ())
    p50_s, p99_s = (_quantile(q, upper_bounds_s, cumulative) for q in (0.5, 0.99))
    top = next(b for b, c in zip(upper_bounds_s, cumulative, strict=True) if c >= total)
    return StageStats(stage, total, p50_s * 1e3, p99_s * 1e3, top * 1e3)


def _quantile(q: float, upper_bounds_s: Sequence[float], cumulative: np.ndarray) -> float:
    """Linear interpolation inside the bucket, as Prometheus' histogram_quantile does."""
    rank = q * cumulative[-1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(upper_bounds_s, cumulative, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def scrape(url: str, timeout_s: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text: str = response.read().decode("utf-8")
    return text


def fetch_stats(url: str, window_s: float = 1.0) -> StatsSnapshot:
    """Scrape `url` twice, `window_s` apart, and report the percentiles in between."""
    before = scrape(url)
    time.sleep(window_s)
    return stats_from_scrapes(before, scrape(url), window_s)
