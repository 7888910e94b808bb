"""Live percentiles: the in-process window, the text format, the reporter, bucket estimates."""

from __future__ import annotations

import logging
import math

from waiting import wait_until

from service.telemetry import format_stats
from service.telemetry.stats import LatencyWindow, LiveStats, StatsReporter, stats_from_scrapes


def test_window_reports_percentiles_of_the_newest_values_and_resets():
    live = LiveStats(window_size=1000)
    for i in range(1, 1001):
        live.windows["end_to_end"].observe(i / 1e6)  # 1 µs .. 1 ms
    live.windows["queue"].observe(0.002)
    snapshot = live.snapshot()
    end_to_end, queue, engine = snapshot.stages
    assert end_to_end.count == 1000
    assert math.isclose(end_to_end.p50_ms, 0.5005, rel_tol=1e-6)
    assert math.isclose(end_to_end.p99_ms, 0.99001, rel_tol=1e-6)
    assert math.isclose(end_to_end.max_ms, 1.0)
    assert queue.count == 1 and math.isclose(queue.p99_ms, 2.0)
    assert engine.count == 0 and math.isnan(engine.p50_ms)
    assert live.snapshot().stages[0].count == 0


def test_window_is_bounded_and_counts_everything():
    window = LatencyWindow(size=10)
    for i in range(25):
        window.observe(float(i))
    count, values = window.drain()
    assert count == 25
    assert len(values) == 10
    assert sorted(values) == [float(i) for i in range(15, 25)]


def test_format_stats_has_one_line_per_stage():
    live = LiveStats(window_size=16)
    live.windows["engine"].observe(0.0015)
    text = format_stats(live.snapshot())
    lines = text.splitlines()
    assert lines[0].startswith("window ")
    assert [line.split()[0] for line in lines[1:]] == ["end_to_end", "queue", "engine"]
    assert "p99=   1.500 ms" in lines[3]


def test_reporter_logs_periodically(caplog):
    live = LiveStats(window_size=16)
    live.windows["end_to_end"].observe(0.004)
    reporter = StatsReporter(live, interval_s=0.05, logger=logging.getLogger("test.stats"))
    with caplog.at_level(logging.INFO, logger="test.stats"):
        reporter.start()
        try:
            wait_until(lambda: any("end_to_end" in r.message for r in caplog.records))
        finally:
            reporter.stop()
    assert any("p50=   4.000 ms" in r.message for r in caplog.records)


def _exposition(counts: dict[str, int]) -> str:
    lines = ["# TYPE riskserve_request_duration_seconds histogram"]
    for le, count in counts.items():
        lines.append(f'riskserve_request_duration_seconds_bucket{{le="{le}"}} {count}')
    total = counts["+Inf"]
    lines.append(f"riskserve_request_duration_seconds_count {total}")
    lines.append("riskserve_request_duration_seconds_sum 1.0")
    return "\n".join(lines) + "\n"


def test_percentiles_from_two_scrapes_interpolate_inside_buckets():
    before = _exposition({"0.001": 10, "0.002": 10, "0.004": 10, "+Inf": 10})
    # 100 new requests: 50 in (0, 1 ms], 40 in (1, 2 ms], 10 in (2, 4 ms].
    after = _exposition({"0.001": 60, "0.002": 100, "0.004": 110, "+Inf": 110})
    stage = stats_from_scrapes(before, after, window_s=1.0).stages[0]
    assert stage.count == 100
    assert math.isclose(stage.p50_ms, 1.0)
    assert math.isclose(stage.p99_ms, 2.0 + 2.0 * 0.9)
    assert math.isclose(stage.max_ms, 4.0)
