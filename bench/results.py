"""Result records shared by the load generators, and the rule for the best rate under budget.

A failed request has no usable latency; it is counted as infinitely slow, so more than 1 %
errors always puts p99 over any budget, and the error-rate limit catches smaller shares.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "PointResult",
    "add_sweep_arguments",
    "best_rate_under_budget",
    "floats",
    "percentiles_ms",
    "report_sweep",
    "summarize",
]

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


@dataclass(frozen=True)
class PointResult:
    """One load point: offered load, what came back, and the latency distribution in ms."""

    server: str
    client: str
    mode: str  # "rate" (open loop, req/s offered) or "concurrency" (closed loop)
    load: float
    duration_s: float
    sent: int
    ok: int
    errors: int
    throughput_rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    mean_ms: float
    error_codes: dict[str, int] = field(default_factory=dict)
    note: str = ""
    server_cpu_s: float = math.nan  # CPU time of the server's processes during the point
    client_cpu_s: float = math.nan  # CPU time of the load client during the point

    @property
    def error_rate(self) -> float:
        return self.errors / self.sent if self.sent else 0.0

    def as_dict(self) -> dict:
        record = asdict(self)
        record["error_rate"] = self.error_rate
        record["server_cpu_ms_per_ok"] = self.server_cpu_s * 1e3 / self.ok if self.ok else None
        record["client_cpu_ms_per_ok"] = self.client_cpu_s * 1e3 / self.ok if self.ok else None
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }

    @classmethod
    def from_dict(cls, record: dict) -> PointResult:
        known = {k: v for k, v in record.items() if k in cls.__dataclass_fields__}
        for key in (
            "p50_ms",
            "p90_ms",
            "p99_ms",
            "p999_ms",
            "mean_ms",
            "server_cpu_s",
            "client_cpu_s",
        ):
            if known.get(key) is None:
                known[key] = math.inf
        return cls(**known)


def percentiles_ms(latencies_s: np.ndarray, failed: int) -> list[float]:
    """p50/p90/p99/p99.9 in ms, with `failed` requests counted as infinitely slow."""
    total = latencies_s.size + failed
    if total == 0:
        return [math.nan] * len(PERCENTILES)
    ordered = np.sort(latencies_s)
    values = []
    for pct in PERCENTILES:
        # Nearest-rank percentile over the successes plus `failed` infinite entries.
        rank = max(1, math.ceil(pct / 100.0 * total))
        values.append(float(ordered[rank - 1]) * 1e3 if rank <= ordered.size else math.inf)
    return values


def summarize(
    *,
    server: str,
    client: str,
    mode: str,
    load: float,
    latencies_s: Sequence[float] | np.ndarray,
    error_codes: Iterable[str],
    sent: int,
    window_s: float,
    note: str = "",
    client_cpu_s: float = math.nan,
) -> PointResult:
    """Builds a PointResult from raw per-request latencies and error codes."""
    latencies = np.asarray(latencies_s, dtype=np.float64)
    codes = Counter(error_codes)
    errors = sum(codes.values())
    p50, p90, p99, p999 = percentiles_ms(latencies, errors)
    return PointResult(
        server=server,
        client=client,
        mode=mode,
        load=load,
        duration_s=window_s,
        sent=sent,
        ok=int(latencies.size),
        errors=errors,
        throughput_rps=latencies.size / window_s if window_s > 0 else 0.0,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        p999_ms=p999,
        mean_ms=float(latencies.mean() * 1e3) if latencies.size else math.nan,
        error_codes=dict(codes),
        note=note,
        client_cpu_s=client_cpu_s,
    )


def best_rate_under_budget(
    points: Iterable[PointResult], budget_ms: float, max_error_rate: float
) -> PointResult | None:
    """The open-loop point with the highest offered rate meeting the p99 budget and error limit."""
    passing = [
        p
        for p in points
        if p.mode == "rate" and p.p99_ms <= budget_ms and p.error_rate <= max_error_rate
    ]
    return max(passing, key=lambda p: p.load, default=None)


def floats(text: str) -> list[float]:
    """A comma-separated list of numbers, as the sweep options take them."""
    return [float(x) for x in text.split(",") if x.strip()]


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every load client's command line shares: target, model, sweep, budget."""
    parser.add_argument("--target", required=True, help="host:port of an OIP gRPC server")
    parser.add_argument("--model-name", default="fraud-demo")
    parser.add_argument(
        "--model", type=Path, default=None, help="ONNX file the inputs are shaped for"
    )
    parser.add_argument("--rates", type=floats, default=[], help="comma-separated req/s")
    parser.add_argument("--concurrency", type=floats, default=[], help="comma-separated callers")
    parser.add_argument("--history-len", type=int, default=32)
    parser.add_argument("--budget-ms", type=float, default=10.0)
    parser.add_argument("--max-error-rate", type=float, default=0.001)
    parser.add_argument("--json", type=Path, default=None, help="write the points here")


def sweep_and_report(client, args: argparse.Namespace) -> int:
    """Runs `client`'s sweep over `--rates` and `--concurrency` and reports it: a client's CLI."""
    concurrency = [int(c) for c in args.concurrency]
    points = client.sweep(args.rates, concurrency, args.budget_ms, args.max_error_rate)
    report_sweep(points, args)
    return 0


def report_sweep(points: Sequence[PointResult], args: argparse.Namespace) -> None:
    """Print the highest rate within budget and write the points where `--json` says."""
    best = best_rate_under_budget(points, args.budget_ms, args.max_error_rate)
    print(
        f"highest rate with p99 <= {args.budget_ms:g} ms and errors <= {args.max_error_rate:.2%}: "
        + (f"{best.load:g} req/s" if best else "none of the rates tried")
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([p.as_dict() for p in points], indent=2))
