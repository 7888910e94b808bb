"""Unary micro-batching: riskserve with batching on and off, and the bare pieces, one run.

perf_analyzer (batch-1 ModelInfer requests on the demo model, closed loop) sweeps the callers
against, in turn: ``riskserve-front`` (as deployed: HAProxy before one worker, unary calls on
its call lane), ``riskserve-front-nobatch`` (the same with RISKSERVE_MAX_BATCH_SIZE=1),
``riskserve`` and ``riskserve-nobatch`` (the lone server, no front) and ``grpc-floor-engine``
(the bare grpc.aio transport running the model on each request's rows, nothing else). Each
point gives the rate, the client's p50 and p99, the server's CPU per request over the steady
part of the point (bench.streaming's measure: HAProxy's included) and, for riskserve, the mean
rows of the batches its engine ran meanwhile (its `riskserve_batch_size` histogram). The
summary compares, as deployed and alone, the best rate whose p99 is within `--p99-ms` with
batching on and off, the p50 at one caller, the mean batch and the CPU per request at `--at`
callers against the bare pieces'. The client shares the cores with the server: compare only
figures of one run.

    .venv/bin/python -m bench.unary_batching
    .venv/bin/python -m bench.unary_batching --concurrency 1,16 \
        --servers riskserve,riskserve-nobatch
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import replace

from bench.compare import FLOOR_ENGINE
from bench.servers import ServerProcess, metric_sum, scrape_metrics
from bench.streaming import (
    Point,
    add_sweep_arguments,
    best_point,
    perf_points,
    point_row,
    started_servers,
)

__all__ = ["main"]

# Batching on and off: as deployed (the front, its HAProxy's CPU counted), and the lone server.
PAIRS = (("riskserve-front", "riskserve-front-nobatch"), ("riskserve", "riskserve-nobatch"))
SERVERS = (*(name for pair in PAIRS for name in pair), FLOOR_ENGINE)


def _batch_rows(metrics_port: int | None) -> tuple[float, float]:
    """Rows and batches the server's engines have run so far (NaN without its metrics)."""
    if metrics_port is None:
        return math.nan, math.nan
    text = scrape_metrics(metrics_port)
    return (
        metric_sum(text, "riskserve_batch_size_sum"),
        metric_sum(text, "riskserve_batch_size_count"),
    )


def sweep(server: ServerProcess, name: str, args: argparse.Namespace) -> list[Point]:
    """One point a concurrency, each with the mean batch it ran in its note."""
    port = server.spec.env.get("RISKSERVE_METRICS_PORT")
    metrics_port = int(port) if port else None
    points = []
    for concurrency in args.concurrency:
        rows_before, batches_before = _batch_rows(metrics_port)
        one = replace_concurrency(args, concurrency)
        (point,) = perf_points(server, name, one, log=lambda _: None, modes=("unary",))
        rows_after, batches_after = _batch_rows(metrics_port)
        batches = batches_after - batches_before
        mean = (rows_after - rows_before) / batches if batches else math.nan
        point = replace(point, note=f"mean batch {mean:.2f}" if math.isfinite(mean) else "")
        print(point_row(point))
        points.append(point)
    return points


def replace_concurrency(args: argparse.Namespace, concurrency: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "concurrency": [concurrency]})


def _mean_batch(point: Point | None) -> float:
    if point is None or not point.note.startswith("mean batch "):
        return math.nan
    return float(point.note.removeprefix("mean batch "))


def summarize(points: Sequence[Point], args: argparse.Namespace) -> None:
    def at(server: str, concurrency: int) -> Point | None:
        return next(
            (p for p in points if p.server == server and p.concurrency == concurrency), None
        )

    def best(server: str) -> Point | None:
        return best_point([p for p in points if p.server == server], args.p99_ms)

    print()
    print(
        "| server | callers | req/s | p50 ms | p99 ms | server CPU µs / request | mean batch rows |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p in points:
        mean = _mean_batch(p)
        print(
            f"| {p.server} | {p.concurrency} | {p.rps:,.0f} | {p.p50_ms:.2f} | {p.p99_ms:.2f} "
            f"| {p.cpu_us_per_request:,.0f} | {f'{mean:.2f}' if math.isfinite(mean) else '-'} |"
        )
    print()
    for name in (*(n for pair in PAIRS for n in pair), FLOOR_ENGINE):
        b = best(name)
        if b is not None:
            print(
                f"best rate with p99 <= {args.p99_ms:g} ms, {name}: {b.rps:,.0f} req/s "
                f"({b.concurrency} callers)"
            )
    floor = at(FLOOR_ENGINE, args.at)
    for batched, unbatched in PAIRS:
        on, off = best(batched), best(unbatched)
        if on and off:
            ratio = on.rps / off.rps
            print(
                f"{batched}: batching on / off, best rate within the budget: {ratio:.2f}x "
                "(target >= 1.3)"
            )
        one_on, one_off = at(batched, 1), at(unbatched, 1)
        if one_on and one_off:
            ratio = one_on.p50_ms / one_off.p50_ms
            print(
                f"{batched}: p50 at 1 caller, batching on / off: {ratio:.2f} (target within 1.05)"
            )
        many = at(batched, args.at)
        if many:
            print(
                f"{batched}: mean batch at {args.at} callers: {_mean_batch(many):.2f} rows "
                "(target >= 3)"
            )
        if many and floor:
            ratio = many.cpu_us_per_request / floor.cpu_us_per_request
            print(
                f"{batched}: server CPU per request at {args.at} callers / {FLOOR_ENGINE}'s: "
                f"{ratio:.2f} (target <= 1)"
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_arguments(parser, SERVERS, (1, 2, 4, 8, 16, 32))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    points: list[Point] = []
    for name, server in started_servers(args, "unary_batching"):
        points += sweep(server, name, args)
    summarize(points, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
