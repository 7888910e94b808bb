"""The `riskserve.batch` span against ONNX Runtime's `session.run` alone, one request at a time.

A server is built in this process on the demo model (ONNX Runtime FP32, tracing on, defaults
otherwise) and its OIP `ModelInfer` handler is called directly, one request after another, so
every batch holds one row. Each executed batch's span (its `BatchTrace`, from dispatch to the
delivery of its scores) is set against the one `session.run` call inside it, timed around that
call alone. What lies between the two is the batcher's own overhead per batch: merging, the
engine pool, the hand-off of the batch and of its result. The table gives medians and p90s over
`--requests` requests after `--warmup` more.

    .venv/bin/python -m bench.batch_span --history-len 16,64,200
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc

from bench.model_io import make_request_arrays, read_model_io, resolve_model_path
from bench.oip import build_infer_request
from service.config import Settings
from service.server import build_server


class _Context:
    """The little of a servicer context the handler reads for a request without a deadline."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


async def _measure(history_lengths: list[int], requests: int, warmup: int) -> list[str]:
    # A budget far above any run here: a stall of the shared machine must not fail a request.
    settings = Settings.model_validate(
        {
            "port": 0,
            "metrics_port": None,
            "trace_file": None,
            "onnx_variants": False,
            "budget_ms": 1000,
        }
    )
    server = await build_server(settings)
    rows = []
    try:
        model = server.registry.get("fraud-demo")
        tracing = model.batcher._tracing
        if tracing is None:
            raise RuntimeError("tracing is off: set RISKSERVE_TRACING=true")
        spans: list[Any] = []
        runs: list[int] = []
        start_batch: Callable[..., Any] = tracing.start_batch

        def traced_batch(*args: Any, **kwargs: Any) -> Any:
            batch = start_batch(*args, **kwargs)
            spans.append(batch)
            return batch

        session = model.pool.fallback._session  # type: ignore[attr-defined]
        run = session.run

        def timed_run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            result = run(*args, **kwargs)
            runs.append(time.perf_counter_ns() - started)
            return result

        tracing.start_batch = traced_batch  # type: ignore[method-assign]
        session.run = timed_run
        io = read_model_io(resolve_model_path(None))
        context = _Context()
        for length in history_lengths:
            request = build_infer_request(
                "fraud-demo", make_request_arrays(io, length, seed=1), io.output
            )
            for _ in range(warmup):
                await server.oip.ModelInfer(request, context)  # type: ignore[arg-type]
            spans.clear()
            runs.clear()
            for _ in range(requests):
                await server.oip.ModelInfer(request, context)  # type: ignore[arg-type]
            span_us = [(b.end_ns - b.start_ns) / 1e3 for b in spans]
            run_us = [r / 1e3 for r in runs]
            gap_us = [s - r for s, r in zip(span_us, run_us, strict=True)]
            rows.append(
                f"| {length} | {statistics.median(run_us):.0f} / {_p90(run_us):.0f} | "
                f"{statistics.median(span_us):.0f} / {_p90(span_us):.0f} | "
                f"{statistics.median(gap_us):.0f} / {_p90(gap_us):.0f} |"
            )
    finally:
        await server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history-len", default="16,64,200", help="comma-separated rows")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=300)
    args = parser.parse_args(argv)
    lengths = [int(v) for v in args.history_len.split(",") if v]
    rows = asyncio.run(_measure(lengths, args.requests, args.warmup))
    print("batch 1, one request at a time; µs, median / p90")
    print("| history rows | session.run alone | riskserve.batch span | span less run |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
