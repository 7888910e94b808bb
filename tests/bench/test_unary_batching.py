"""bench.unary_batching's summary: the issue's comparisons, from the points of one run."""

from __future__ import annotations

from bench.streaming import Point
from bench.unary_batching import parse_args, summarize


def point(server: str, callers: int, rps: float, p50: float, p99: float, cpu: float, batch: str):
    return Point(server, "unary", callers, rps, p50, p99, cpu, 0, batch)


def test_the_summary_compares_batching_on_off_and_the_bare_pieces(capsys):
    points = [
        point("riskserve", 1, 1000, 0.70, 0.9, 600, "mean batch 1.00"),
        point("riskserve", 16, 3000, 5.0, 9.5, 400, "mean batch 3.50"),
        point("riskserve", 32, 3200, 10.0, 16.0, 390, "mean batch 3.90"),
        point("riskserve-nobatch", 1, 1000, 0.68, 0.9, 600, "mean batch 1.00"),
        point("riskserve-nobatch", 16, 2000, 7.0, 9.9, 500, "mean batch 1.00"),
        point("grpc-floor-engine", 16, 4000, 4.0, 6.0, 320, ""),
    ]
    summarize(points, parse_args(["--concurrency", "1,16,32"]))
    out = capsys.readouterr().out
    assert "| riskserve | 16 | 3,000 | 5.00 | 9.50 | 400 | 3.50 |" in out
    assert "| grpc-floor-engine | 16 | 4,000 | 4.00 | 6.00 | 320 | - |" in out
    # The best rates within 10 ms are 3,000 (on, 16 callers) and 2,000 (off).
    assert "batching on / off, best rate within the budget: 1.50x" in out
    assert "p50 at 1 caller, batching on / off: 1.03" in out
    assert "mean batch at 16 callers: 3.50 rows" in out
    assert "server CPU per request at 16 callers / grpc-floor-engine's: 1.25" in out
