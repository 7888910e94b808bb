"""Shadow and A/B evaluation under `make loadtest`'s default load: what they cost the champion.

Back to back, each configuration on a fresh server with its defaults (tracing and metrics on,
traces kept nowhere), the load test's own mix (loadtest/locustfile.py) at `--rate` req/s (make
loadtest's default, 40 users x 10 req/s) for `--duration-s`, locust on the same machine,
unpinned, as `make loadtest` runs it:

- no experiment: versions 1 and 2 of the demo model loaded, version 1 pinned, nothing logged;
- shadow: champion 1, challenger 2 (a copy of the demo model, so the same cost) scoring a
  shadow copy of every request in the shadow worker;
- A/B: champion 1, challenger 2 answering half the entities on the request path, every row
  logged;
- the floor, no experiment with a champion that runs the demo model twice in one graph: the
  same traffic with the challenger's engine calls added in process, what shadowing should cost
  at most;
- (with `--only`) shadow with the worker stopped (SIGSTOP) and a queue that never fills in a
  run: what handing the copies over costs the server, without the worker's computation.

`--load-factors 1,2` adds the shadow run at twice the load (and more), where the worker may not
keep up and what it scores is a deterministic share of the entities.

Per run it prints locust's requests, failures, p50 and p99 (each call timed from when it was
due), the p99 against the no-experiment run's, the server's CPU per request and its ratio to
the no-experiment run's, the shadow worker's CPU (share of one core over the run) and its
largest resident memory, and the coverage: served rows with a challenger record, out of the
served rows logged, and the share the worker was sampling at the end.

    .venv/bin/python -m bench.shadow_load --duration-s 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.compose
import psutil
from onnx import helper, numpy_helper

from bench.loadtest_sweep import (
    RPS_PER_USER,
    _aggregated,
    _bucket_quantile_ms,
    _locust,
    _number,
    _server_counts,
)
from bench.results import floats
from bench.servers import ServerProcess, ServerSpec, free_port, metric_sum, scrape_metrics
from bench.shadow_overhead import _worker_cpu_s, _workers

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "fraud-demo" / "1"
RISKSERVE = REPO / ".venv" / "bin" / "riskserve"
BASELINE, FLOOR, SHADOW, AB = "no experiment", "floor: engine twice", "shadow", "A/B"
HAND_OFF = "shadow, worker stopped"
_SHADOW_ARMS = {"champion": "1", "challengers": ["2"], "mode": "shadow", "shadow_share": 1.0}
ARMS: dict[str, dict[str, object] | None] = {
    BASELINE: None,
    FLOOR: None,
    SHADOW: _SHADOW_ARMS,
    AB: {"champion": "1", "challengers": ["2"], "mode": "ab", "ab_share": 0.5},
    HAND_OFF: _SHADOW_ARMS,
}
DEFAULT_CONFIGS = (BASELINE, FLOOR, SHADOW, AB)


@dataclass(frozen=True)
class Run:
    config: str
    load_factor: float
    offered_rps: float
    requests: int
    failures: int
    p50_ms: float
    p99_ms: float
    server_cpu_us_per_request: float
    worker_cpu_share: float
    worker_peak_rss_mb: float
    served_rows: int
    challenger_rows: int
    sampled_share: float
    # The server's own p99: the bound of its request-duration histogram's bucket holding it.
    server_p99_ms: float = math.nan


def copy_demo(root: Path, version: str) -> Path:
    """The demo model's folder (variants and their validation too) as `version`."""
    target = root / "fraud-demo" / version
    shutil.copytree(DEMO, target)
    for name in ("manifest.json", "validation.json"):
        path = target / name
        if path.exists():
            data = json.loads(path.read_text())
            data["version"] = version
            path.write_text(json.dumps(data, indent=2))
    return target


def doubled_demo(root: Path) -> Path:
    """Version 1 of the demo model, FP32 only, whose graph computes the model twice (two
    renamed copies fed the same inputs) and answers the mean of the two scores."""
    target = root / "fraud-demo" / "1"
    target.mkdir(parents=True)
    model = onnx.load(DEMO / "model.onnx")
    copies = [onnx.compose.add_prefix(model, prefix) for prefix in ("a_", "b_")]
    output = model.graph.output[0].name
    nodes = [
        helper.make_node("Identity", [i.name], [f"{prefix}{i.name}"])
        for prefix in ("a_", "b_")
        for i in model.graph.input
    ]
    for copy in copies:
        nodes += copy.graph.node
    nodes += [
        helper.make_node("Add", [f"a_{output}", f"b_{output}"], ["sum_of_two"]),
        helper.make_node("Mul", ["sum_of_two", "one_half"], [output]),
    ]
    half = numpy_helper.from_array(np.array(0.5, dtype=np.float32), "one_half")
    graph = helper.make_graph(
        nodes,
        "demo-twice",
        list(model.graph.input),
        list(model.graph.output),
        initializer=[*copies[0].graph.initializer, *copies[1].graph.initializer, half],
    )
    twice = helper.make_model(graph, opset_imports=list(model.opset_import))
    twice.ir_version = model.ir_version
    onnx.save(twice, target / "model.onnx")
    manifest = json.loads((DEMO / "manifest.json").read_text())
    manifest["variants"] = {}
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return target


class _WorkerWatch:
    """Samples the shadow workers' resident memory while a run lasts; sums their CPU."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak_rss = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def cpu_seconds(self) -> float:
        return _worker_cpu_s()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            for process in _workers():
                with contextlib.suppress(psutil.Error):
                    self.peak_rss = max(self.peak_rss, process.memory_info().rss)

    def __enter__(self) -> _WorkerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def _coverage(logs: Path) -> tuple[int, int]:
    """Served rows logged, and challenger rows logged for them."""
    from service.shadow import NoRecords, read_records

    try:
        table = read_records(str(logs)).select(["served", "request_id"])
    except NoRecords:
        return 0, 0
    served = table.column("served").to_pylist()
    return sum(served), len(served) - sum(served)


def run(config: str, factor: float, args: argparse.Namespace, tmp: Path) -> Run:
    port, metrics_port = free_port(), free_port()
    logs = tmp / "logs" / f"{port}"
    rate = args.rate * factor
    env = {
        "RISKSERVE_MODELS_DIR": str(tmp / ("floor" if config == FLOOR else "models")),
        "RISKSERVE_METRICS_PORT": str(metrics_port),
        "RISKSERVE_TRACE_FILE": "none",
        "RISKSERVE_SHADOW_LOG_PREFIX": str(logs),
        "RISKSERVE_PINNED_VERSIONS": json.dumps({"fraud-demo": "1"}),
    }
    arms = ARMS[config]
    if arms is not None:
        experiments = tmp / f"experiments-{port}.json"
        experiments.write_text(json.dumps({"models": {"fraud-demo": arms}}))
        env["RISKSERVE_EXPERIMENTS_FILE"] = str(experiments)
    if config == HAND_OFF:
        env["RISKSERVE_SHADOW_MAX_QUEUED_JOBS"] = str(10**6)
    argv = (str(RISKSERVE), "serve", "--port", str(port))
    spec = ServerSpec(config, argv, port, "fraud-demo", env=env, cwd=REPO)
    with ServerProcess(spec, tmp / f"server-{port}.log") as server:
        # Connect, warm caches and let the shadow worker start and load its engine.
        _locust(server.target, min(rate, 100.0), 5.0, tmp / f"warm-{port}", 1)
        if config == HAND_OFF:
            for process in _workers():
                process.suspend()
        with _WorkerWatch() as watch:
            cpu_before, worker_before = server.cpu_seconds(), watch.cpu_seconds()
            buckets_before = _server_counts(metrics_port, 1)[2]
            started = time.monotonic()
            prefix = tmp / f"run-{port}"
            _locust(server.target, rate, args.duration_s, prefix, 1)
            elapsed_s = time.monotonic() - started
            cpu_s = server.cpu_seconds() - cpu_before
            worker_s = watch.cpu_seconds() - worker_before
            buckets = _server_counts(metrics_port, 1)[2]
        if config == HAND_OFF:
            for process in _workers():
                process.resume()
        share = math.nan
        if arms is not None and arms["mode"] == "shadow":
            with contextlib.suppress(Exception):
                text = scrape_metrics(metrics_port)
                share = metric_sum(text, "riskserve_shadow_sampled_share")
    served, challenger = _coverage(logs)
    row = _aggregated(prefix)
    requests = int(_number(row, "Request Count"))
    return Run(
        config=config,
        load_factor=factor,
        offered_rps=rate,
        requests=requests,
        failures=int(_number(row, "Failure Count")),
        p50_ms=_number(row, "50%"),
        p99_ms=_number(row, "99%"),
        server_cpu_us_per_request=cpu_s * 1e6 / requests if requests else math.nan,
        worker_cpu_share=worker_s / elapsed_s,
        worker_peak_rss_mb=watch.peak_rss / 2**20,
        served_rows=served,
        challenger_rows=challenger,
        sampled_share=share,
        server_p99_ms=_bucket_quantile_ms(buckets_before, buckets, 0.99),
    )


def _ratio(value: float, base: float | None) -> str:
    if base is None or not base or math.isnan(value) or math.isnan(base):
        return "-"
    return f"{value / base:.2f}x"


def _median_run(runs: list[Run]) -> Run:
    """The run whose p99 is the median (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r.p99_ms)
    return ordered[(len(ordered) - 1) // 2]


def report(runs: list[Run]) -> None:
    print(
        "| configuration | load | requests | failures | p50 ms | p99 ms (each run) "
        "| p99 / no experiment | server p99 ms (bucket) | server CPU µs/req | / no experiment "
        "| worker CPU | worker RSS MB "
        "| challenger coverage | sampled share |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = list(dict.fromkeys((r.config, r.load_factor) for r in runs))
    medians = {
        key: _median_run([r for r in runs if (r.config, r.load_factor) == key]) for key in keys
    }
    for config, factor in keys:
        mine = [r for r in runs if (r.config, r.load_factor) == (config, factor)]
        r = medians[(config, factor)]
        base = medians.get((BASELINE, factor))
        compared = config != BASELINE and base is not None
        worker = config in (SHADOW, HAND_OFF)
        coverage = "-"
        served = sum(x.served_rows for x in mine)
        if worker and served:
            covered = sum(x.challenger_rows for x in mine) / served
            coverage = f"{covered:.2%} of {served:,}"
        cpu = float(np.mean([x.server_cpu_us_per_request for x in mine]))
        base_cpu = (
            float(np.mean([x.server_cpu_us_per_request for x in runs
                           if (x.config, x.load_factor) == (BASELINE, factor)]))
            if compared else math.nan
        )  # fmt: skip
        each = ", ".join(f"{x.p99_ms:g}" for x in mine)
        print(
            f"| {config} | {r.offered_rps:g} req/s | {sum(x.requests for x in mine):,} "
            f"| {sum(x.failures for x in mine)} | {r.p50_ms:g} | {r.p99_ms:g} ({each}) "
            f"| {_ratio(r.p99_ms, base.p99_ms) if compared and base else ''} "
            f"| {', '.join(f'{x.server_p99_ms:g}' for x in mine)} "
            f"| {cpu:.0f} | {_ratio(cpu, base_cpu) if compared else ''} "
            f"| {f'{max(x.worker_cpu_share for x in mine):.0%}' if worker else '-'} "
            f"| {f'{max(x.worker_peak_rss_mb for x in mine):.0f}' if worker else '-'} "
            f"| {coverage} "
            f"| {f'{min(x.sampled_share for x in mine):g}' if worker else '-'} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rate", type=float, default=400.0, help="offered req/s (make loadtest's default)"
    )
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument(
        "--load-factors", type=floats, default=[1.0], help="shadow runs at these multiples"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration")
    parser.add_argument("--only", action="append", choices=list(ARMS), help="configs to run")
    args = parser.parse_args(argv)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="shadow-load-") as name:
        tmp = Path(name)
        copy_demo(tmp / "models", "1")
        copy_demo(tmp / "models", "2")
        doubled_demo(tmp / "floor")
        configs = args.only or DEFAULT_CONFIGS
        plan = [(config, 1.0) for config in configs]
        plan += [
            (config, factor)
            for factor in args.load_factors
            if factor != 1.0
            for config in (BASELINE, SHADOW)
            if config in configs
        ]
        # Interleaved, so that a slow spell of the machine falls on every configuration alike.
        for _ in range(args.repeats):
            for config, factor in plan:
                runs.append(run(config, factor, args, tmp))
                print(json.dumps(runs[-1].__dict__), flush=True)
    print(
        f"\nlocust mix of make loadtest, {args.duration_s:g} s a run, "
        f"{args.rate / RPS_PER_USER:g} users x {RPS_PER_USER} req/s at load 1, "
        f"{args.repeats} run(s) of each; the median run by p99"
    )
    report(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
