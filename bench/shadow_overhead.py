"""What shadow mode costs the champion: Score p50/p99 with no experiment, with a challenger
scoring a shadow copy of every request, and with a shadow queue that stays full (copies beyond
it are dropped and counted).

Challengers: version 2 is a copy of the demo model (the same cost as the champion); version 3
takes the same inputs but spends tens of ms per call on a large matrix product, so with a
queue of one job its worker is always busy and nearly every copy is dropped. Another
configuration stops the worker (SIGSTOP) during the load, so the queue stays full and the
worker takes no CPU: the full queue's own cost (the case where shadowing must cost the champion
nothing), apart from what a busy challenger's computation costs on shared cores. A pinned
pair runs the server under `taskset -c 0` and, in the one with the slow challenger, its worker
on CPU 1 (RISKSERVE_SHADOW_CPUS): a costly challenger on a core of its own. Load:
open-loop Poisson arrivals of Score requests at each rate, latency from each request's
scheduled send time. The load generator runs on the same machine. Each configuration is
served by a fresh server, in turn, `--repeats` times.

    .venv/bin/python -m bench.shadow_overhead --rates 100,300 --duration-s 10 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import psutil
from onnx import TensorProto, helper, numpy_helper

from bench.results import floats
from bench.score_load import ScoreStream, open_loop, score_requests
from bench.servers import (
    SHADOW_WORKER,
    ServerProcess,
    ServerSpec,
    free_port,
    metric_sum,
    scrape_metrics,
)

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "fraud-demo" / "1"
SLOW_MATRIX = 1024  # version 3's product of two SLOW_MATRIX-square matrices per engine call
WARMUP_REQUESTS = 50


class Config(NamedTuple):
    """One configuration: the challenger version (None: no experiment; "ab" serves and logs
    the champion only, an A/B split of 0: the experiment's own cost without any shadow copy or
    worker) and the server's extra environment."""

    version: str | None
    env: dict[str, str]
    # The server runs under `taskset -c 0`; its p99 is compared with the pinned baseline's.
    server_on_cpu0: bool = False
    # The shadow worker is stopped (SIGSTOP) for the measured load: the first copy fills the
    # queue of one job and every later copy is dropped, while the worker takes no CPU, so what
    # is measured is the full queue's own cost to the champion, apart from a busy challenger's.
    stop_worker: bool = False


ONE_JOB = {"RISKSERVE_SHADOW_MAX_QUEUED_JOBS": "1"}
BASELINE, PINNED_BASELINE = "no experiment", "no experiment, server on CPU 0"
CONFIGS: dict[str, Config] = {
    BASELINE: Config(None, {}),
    "experiment logged, no shadow": Config("ab", {}),
    "shadow every request": Config("2", {}),
    "shadow, queue of 1 job": Config("2", ONE_JOB),
    "shadow, queue full (slow challenger, 1 job)": Config("3", ONE_JOB),
    "shadow, queue full (worker stopped, 1 job)": Config("2", ONE_JOB, stop_worker=True),
    # The slow challenger on a core of its own: the server (and so its engine threads) on CPU
    # 0 alone, the worker on CPU 1 alone; compared with the pinned baseline.
    PINNED_BASELINE: Config(None, {}, server_on_cpu0=True),
    "slow challenger on CPU 1, server on CPU 0 (1 job)": Config(
        "3", {**ONE_JOB, "RISKSERVE_SHADOW_CPUS": "1"}, server_on_cpu0=True
    ),
}


def _copy_demo(root: Path, version: str) -> Path:
    target = root / "fraud-demo" / version
    target.mkdir(parents=True)
    for name in ("model.onnx", "manifest.json"):
        shutil.copy(DEMO / name, target / name)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest.update(version=version, variants={})
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def _slow_model(path: Path, n_features: int, n_fields: int) -> None:
    """sigmoid(features . w) plus zero times a product of two large matrices that depends on
    the input, so ONNX Runtime cannot fold it away: a challenger far slower than the demo."""
    rng = np.random.default_rng(3)
    square = (rng.normal(size=(SLOW_MATRIX, SLOW_MATRIX)) * 0.01).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["features", "w"], ["xw"]),
        helper.make_node("ReduceSum", ["features"], ["total"], keepdims=0),
        helper.make_node("Mul", ["total", "zero"], ["nothing"]),
        helper.make_node("Add", ["nothing", "one"], ["unit"]),
        helper.make_node("Mul", ["square", "unit"], ["scaled"]),
        helper.make_node("MatMul", ["scaled", "square"], ["product"]),
        helper.make_node("ReduceMean", ["product"], ["heavy"], keepdims=0),
        helper.make_node("ReduceSum", ["history"], ["hsum"], keepdims=0),
        helper.make_node("ReduceSum", ["history_mask"], ["msum"], keepdims=0),
        helper.make_node("Sum", ["heavy", "hsum", "msum"], ["side"]),
        helper.make_node("Mul", ["side", "zero"], ["side_zero"]),
        helper.make_node("Add", ["xw", "side_zero"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["score"]),
    ]
    graph = helper.make_graph(
        nodes,
        "slow-challenger",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", n_features]),
            helper.make_tensor_value_info("history", TensorProto.FLOAT, ["batch", "t", n_fields]),
            helper.make_tensor_value_info("history_mask", TensorProto.FLOAT, ["batch", "t"]),
        ],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        initializer=[
            numpy_helper.from_array(
                (rng.normal(size=(n_features, 1)) * 0.1).astype(np.float32), "w"
            ),
            numpy_helper.from_array(square, "square"),
            numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
            numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def _models(root: Path) -> Path:
    """Versions 1 (champion), 2 (a copy) and 3 (slow); the baseline's folder holds 1 only, as
    without an experiment the highest version serves."""
    _copy_demo(root.with_name("baseline"), "1")
    _copy_demo(root, "1")
    _copy_demo(root, "2")
    slow = _copy_demo(root, "3")
    manifest = json.loads((slow / "manifest.json").read_text())
    _slow_model(slow / "model.onnx", len(manifest["features"]), len(manifest["history"]["fields"]))
    return root


def _challenger_rows(prefix: Path) -> tuple[int, float]:
    """Challenger rows the shadow worker logged, and their median engine latency in ms."""
    from service.shadow import read_records

    if not prefix.exists():
        return 0, float("nan")
    table = read_records(str(prefix)).select(["served", "latency_ms"]).to_pylist()
    latencies = [r["latency_ms"] for r in table if not r["served"]]
    return len(latencies), float(np.median(latencies)) if latencies else float("nan")


def _drops(metrics_port: int) -> int:
    return int(metric_sum(scrape_metrics(metrics_port), "riskserve_shadow_drops_total"))


def _workers() -> list[psutil.Process]:
    """The running shadow worker processes (they are not in the server's process group)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if SHADOW_WORKER in (process.info["cmdline"] or ()):
            found.append(process)
    return found


def _worker_cpu_s() -> float:
    """CPU seconds (user and system) of the running shadow worker processes."""
    total = 0.0
    for process in _workers():
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def _signal_workers(signum: int) -> int:
    sent = 0
    for process in _workers():
        with contextlib.suppress(psutil.Error):
            process.send_signal(signum)
            sent += 1
    return sent


def _run(root: Path, tmp: Path, name: str, rate: float, args, payloads) -> dict:
    config = CONFIGS[name]
    version = config.version
    port, metrics_port = free_port(), free_port()
    logs = tmp / "logs" / str(port)
    env = {
        "RISKSERVE_MODELS_DIR": str(root if version else root.with_name("baseline")),
        "RISKSERVE_METRICS_PORT": str(metrics_port),
        "RISKSERVE_TRACE_FILE": "none",
        "RISKSERVE_BUDGET_MS": "1000",
        "RISKSERVE_SHADOW_LOG_PREFIX": str(logs),
        **config.env,
    }
    if version is not None:
        experiments = tmp / f"experiments-{version}.json"
        arms: dict[str, object] = {"champion": "1", "challengers": [version], "mode": "shadow"}
        if version == "ab":
            arms = {"champion": "1", "challengers": ["2"], "mode": "ab", "ab_share": 0.0}
        experiments.write_text(json.dumps({"models": {"fraud-demo": arms}}))
        env["RISKSERVE_EXPERIMENTS_FILE"] = str(experiments)
    argv: tuple[str, ...] = (
        str(REPO / ".venv" / "bin" / "riskserve"),
        "serve",
        "--port",
        str(port),
    )
    if config.server_on_cpu0:
        argv = ("taskset", "-c", "0", *argv)
    spec = ServerSpec(
        name=name,
        argv=argv,
        grpc_port=port,
        model_name="fraud-demo",
        env=env,
        cwd=REPO,
    )
    log = REPO / "bench" / "results" / f"shadow_overhead_{port}.log"
    with ServerProcess(spec, log) as server:
        before: list[float] = []
        stopped = 0

        def on_start() -> None:
            nonlocal stopped
            if config.stop_worker:
                stopped = _signal_workers(signal.SIGSTOP)
                if not stopped:
                    raise RuntimeError(f"{name}: no shadow worker to stop")
            before.extend((server.cpu_seconds(), _worker_cpu_s()))

        try:
            stream = ScoreStream.poisson(payloads, rate, args.duration_s, seed=7)
            asyncio.run(
                open_loop(
                    server.target,
                    [stream],
                    on_start,
                    warmup=WARMUP_REQUESTS,
                    # the shadow worker loads its engine at idle priority meanwhile
                    settle_s=3.0,
                    timeout_s=5.0,
                )
            )
        finally:
            if stopped:
                _signal_workers(signal.SIGCONT)
        cpu, worker_cpu = server.cpu_seconds() - before[0], _worker_cpu_s() - before[1]
        time.sleep(1.5)  # the drop metric is published once a second
        dropped = _drops(metrics_port)
    logged, challenger_ms = _challenger_rows(logs)
    ms = stream.latencies_ms()
    p50, p99 = np.percentile(ms, [50, 99])
    return dict(
        config=name, rate=rate, sent=len(stream.offsets), ok=len(ms), errors=stream.errors,
        p50=p50, p99=p99,
        cpu=cpu, worker_cpu=worker_cpu, logged=logged, dropped=dropped,
        challenger_ms=challenger_ms,
    )  # fmt: skip


def sweep(args: argparse.Namespace) -> int:
    payloads = score_requests(500, max_history=32, prefix="s")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = _models(Path(tmp) / "models")
        for repeat in range(args.repeats):
            for rate in args.rates:
                for name in args.only or CONFIGS:
                    run = _run(root, Path(tmp), name, rate, args, payloads)
                    runs.append({**run, "repeat": repeat + 1})
                    print(json.dumps({k: v for k, v in runs[-1].items()}, default=str))
    print(f"\nScore, history <= 32 rows, {args.duration_s:g} s per run; copies = requests + "
          f"{WARMUP_REQUESTS} warm-up; figures run by run")  # fmt: skip
    print(
        "| rate req/s | configuration | champion p99 ms | against no experiment ms "
        "| errors | worker CPU s | copies scored / dropped |"
    )
    print("|---:|---|---|---|---:|---|---|")
    for rate in args.rates:
        for name in args.only or CONFIGS:
            mine = [r for r in runs if r["rate"] == rate and r["config"] == name]
            # `--only` may leave out the baseline: then there is nothing to compare with.
            baseline = PINNED_BASELINE if CONFIGS[name].server_on_cpu0 else BASELINE
            against = []
            for r in mine:
                base = next(
                    (b["p99"] for b in runs
                     if b["config"] == baseline and b["rate"] == rate
                     and b["repeat"] == r["repeat"]),
                    None,
                )  # fmt: skip
                if name != baseline and base is not None:
                    against.append(f"{r['p99'] - base:+.2f}")
            p99 = " / ".join(f"{r['p99']:.2f}" for r in mine)
            worker = " / ".join(f"{r['worker_cpu']:.1f}" for r in mine)
            errors = sum(sum(r["errors"].values()) for r in mine)
            copies = ""
            if name != baseline:
                copies = ", ".join(f"{r['logged']:,.0f} / {r['dropped']:,.0f}" for r in mine)
            print(
                f"| {rate:g} | {name} | {p99} | {' / '.join(against)} | {errors} | {worker} "
                f"| {copies} |"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=floats, default=[100.0, 300.0], help="req/s, comma list")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", action="append", choices=list(CONFIGS), help="configs to run")
    args = parser.parse_args(argv)
    return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
