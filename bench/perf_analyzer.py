"""Drives Triton's perf_analyzer (from the tritonclient 2.51 wheel) against any OIP gRPC server.

perf_analyzer is a C++ client, so it takes far less of the shared CPU than the Python load
generator. It reads the model's ``max_batch_size`` through Triton's ``ModelConfig`` RPC, so it
works against Triton and riskserve but not MLServer. Each load point is one perf_analyzer run;
its CSV (``-f``) gives the throughput and p50/p90/p99 (it has no p99.9, and the 2.51 binary
wrote empty profile exports here, so p99.9 is left unknown), its summary the mean latency and
the request count. In request-rate mode perf_analyzer times each request from its actual send,
not from the schedule, and says which share of its sends fell behind; that share is kept in
the point's note. perf_analyzer stops on failed requests, so a failed run is one error point.

    .venv/bin/python -m bench.perf_analyzer --target 127.0.0.1:8001 --rates 500,1000 \
        --concurrency 1,8
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.model_io import REPO_ROOT, make_request_arrays, read_model_io, resolve_model_path
from bench.results import PointResult, add_sweep_arguments, sweep_and_report

__all__ = ["PerfAnalyzer", "PerfPlan", "main"]

PEERS_DIR = REPO_ROOT / "bench" / ".peers"
PERF_BIN = PEERS_DIR / "perf-venv" / "bin" / "perf_analyzer"
PERF_LIBS = PEERS_DIR / "perf-libs"


@dataclass(frozen=True)
class PerfPlan:
    """One sweep's settings; each point measures `windows` windows of `window_s` seconds."""

    target: str
    model_name: str = "fraud-demo"
    history_len: int = 32
    window_s: float = 2.0
    windows: int = 3
    max_threads: int = 16
    timeout_s: float = 120.0
    streaming: bool = False  # ModelStreamInfer: one stream per concurrent request slot


class PerfAnalyzer:
    """Runs perf_analyzer once per load point and turns its output into PointResults."""

    def __init__(
        self, plan: PerfPlan, onnx_path: Path | None = None, server_label: str = ""
    ) -> None:
        if not PERF_BIN.exists():
            raise FileNotFoundError(f"no {PERF_BIN}; run bench/peers/setup.sh first")
        self.plan = plan
        self.server_label = server_label or plan.target
        self.io = read_model_io(resolve_model_path(onnx_path))
        self._tmp = tempfile.TemporaryDirectory(prefix="perf-analyzer-")
        self._input_data = Path(self._tmp.name) / "input.json"
        self._write_input_data()

    def close(self) -> None:
        self._tmp.cleanup()

    def __enter__(self) -> PerfAnalyzer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write_input_data(self) -> None:
        # The same tensors the Python load generator sends (batch axis dropped: -b 1 adds it).
        arrays = make_request_arrays(self.io, self.plan.history_len, seed=1)
        entry = {
            name: {"content": array[0].reshape(-1).tolist(), "shape": list(array.shape[1:])}
            for name, array in arrays.items()
        }
        self._input_data.write_text(json.dumps({"data": [entry]}))

    def _argv(self, mode: str, load: float, csv_path: Path) -> list[str]:
        io, plan = self.io, self.plan
        argv = [
            str(PERF_BIN),
            "-m",
            plan.model_name,
            "-u",
            plan.target,
            "-i",
            "grpc",
            "-b",
            "1",
            "--shape",
            f"{io.features_input}:{io.n_features}",
            "--shape",
            f"{io.history_input}:{plan.history_len},{io.n_history_fields}",
            "--shape",
            f"{io.mask_input}:{plan.history_len}",
            "--input-data",
            str(self._input_data),
            "--measurement-mode",
            "time_windows",
            "--measurement-interval",
            str(int(plan.window_s * 1000)),
            # Stop after `windows` windows whatever their spread: a bounded run per point.
            "--max-trials",
            str(plan.windows),
            "--stability-percentage",
            "1000",
            "--percentile",
            "99",
            "--max-threads",
            str(plan.max_threads),
            "--async",
            "-f",
            str(csv_path),
        ]
        if plan.streaming:
            argv.append("--streaming")
        if mode == "rate":
            argv += ["--request-rate-range", f"{load:g}", "--request-distribution", "poisson"]
        else:
            argv += ["--concurrency-range", f"{int(load)}"]
        return argv

    def run_point(self, mode: str, load: float) -> PointResult:
        csv_path = Path(self._tmp.name) / "report.csv"
        csv_path.unlink(missing_ok=True)
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": ":".join(
                p for p in (str(PERF_LIBS), os.environ.get("LD_LIBRARY_PATH")) if p
            ),
        }
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            proc = subprocess.run(
                self._argv(mode, load, csv_path),
                env=env,
                capture_output=True,
                text=True,
                timeout=self.plan.timeout_s,
            )
        except subprocess.TimeoutExpired:
            return self._failed_point(mode, load, f"no result within {self.plan.timeout_s:g} s")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        client_cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        if proc.returncode != 0 or not csv_path.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            return self._failed_point(mode, load, " | ".join(tail))
        point = self._parse(mode, load, csv_path, proc.stdout)
        # Includes perf_analyzer's start-up and all its windows, so it is an upper bound.
        return replace(point, client_cpu_s=client_cpu_s)

    def _failed_point(self, mode: str, load: float, why: str) -> PointResult:
        return PointResult(
            server=self.server_label,
            client="perf_analyzer",
            mode=mode,
            load=load,
            duration_s=0.0,
            sent=0,
            ok=0,
            errors=1,
            throughput_rps=0.0,
            p50_ms=math.inf,
            p90_ms=math.inf,
            p99_ms=math.inf,
            p999_ms=math.inf,
            mean_ms=math.inf,
            error_codes={"PERF_ANALYZER_FAILED": 1},
            note=why,
        )

    def _parse(self, mode: str, load: float, csv_path: Path, stdout: str) -> PointResult:
        with csv_path.open() as handle:
            row = next(csv.DictReader(handle))

        def ms(key: str) -> float:
            return float(row[key]) / 1e3  # perf_analyzer reports microseconds

        count = _last_number(r"Request count:\s*(\d+)", stdout)
        mean_us = _last_number(r"Avg latency:\s*(\d+)\s*usec", stdout)
        delayed = _last_number(r"([\d.]+)% of the requests were delayed", stdout)
        window_s = self.plan.window_s
        return PointResult(
            server=self.server_label,
            client="perf_analyzer",
            mode=mode,
            load=load,
            duration_s=window_s,
            sent=int(count) if math.isfinite(count) else 0,
            ok=int(count) if math.isfinite(count) else 0,
            errors=0,
            throughput_rps=float(row["Inferences/Second"]),
            p50_ms=ms("p50 latency"),
            p90_ms=ms("p90 latency"),
            p99_ms=ms("p99 latency"),
            p999_ms=math.nan,
            mean_ms=mean_us / 1e3,
            note=f"perf_analyzer: {delayed:g}% of sends delayed" if math.isfinite(delayed) else "",
        )

    def sweep(
        self,
        rates: Sequence[float] = (),
        concurrencies: Sequence[int] = (),
        budget_ms: float = 10.0,
        max_error_rate: float = 0.001,
        stop_after_failures: int = 2,
        log=print,
        server_cpu: Callable[[], float] | None = None,
    ) -> list[PointResult]:
        """As LoadGenerator.sweep, one perf_analyzer run per point."""
        from bench.loadgen import run_sweep

        return run_sweep(
            self.run_point,
            rates,
            concurrencies,
            budget_ms,
            max_error_rate,
            stop_after_failures,
            log,
            server_cpu,
            cooldown_s=1.0,
        )


def _last_number(pattern: str, text: str) -> float:
    """The last match of `pattern`'s group in perf_analyzer's summary, or NaN."""
    found = re.findall(pattern, text)
    return float(found[-1]) if found else math.nan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_arguments(parser)
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--windows", type=int, default=3)
    args = parser.parse_args(argv)
    plan = PerfPlan(
        target=args.target,
        model_name=args.model_name,
        history_len=args.history_len,
        window_s=args.window_s,
        windows=args.windows,
    )
    with PerfAnalyzer(plan, args.model) as analyzer:
        return sweep_and_report(analyzer, args)


if __name__ == "__main__":
    sys.exit(main())
