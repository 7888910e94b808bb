"""The load-test sweep's reading of the server's own latency from its histogram."""

from __future__ import annotations

import math

from bench.loadtest_sweep import _bucket_quantile_ms


def test_server_quantiles_come_from_the_requests_counted_between_two_scrapes():
    before = {0.001: 10.0, 0.002: 10.0, 0.005: 10.0, math.inf: 10.0}
    # 200 requests between the scrapes: 50 within 1 ms, 90 more within 2 ms, 59 more within
    # 5 ms, one slower.
    after = {0.001: 60.0, 0.002: 150.0, 0.005: 209.0, math.inf: 210.0}
    assert _bucket_quantile_ms(before, after, 0.25) == 1.0
    assert _bucket_quantile_ms(before, after, 0.50) == 2.0
    assert _bucket_quantile_ms(before, after, 0.99) == 5.0
    assert _bucket_quantile_ms(before, after, 1.0) == math.inf


def test_no_requests_between_the_scrapes_give_no_quantile():
    counts = {0.001: 3.0, math.inf: 3.0}
    assert math.isnan(_bucket_quantile_ms(counts, counts, 0.5))
    assert math.isnan(_bucket_quantile_ms({}, {}, 0.5))
