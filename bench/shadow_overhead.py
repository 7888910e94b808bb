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

`--micro` instead times the server's side of a shadow copy in-process, with a real worker:
`ShadowRunner.submit` of an accepted job and the full-queue drop path.
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

import grpc
import numpy as np
import onnx
import psutil
from onnx import TensorProto, helper, numpy_helper

from bench.results import floats
from bench.servers import ServerProcess, ServerSpec, free_port, metric_sum, scrape_metrics
from demo.generator import FEATURE_NAMES, generate
from riskscoring.v1 import risk_scoring_pb2 as pb

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


def _requests(n: int) -> list[bytes]:
    data = generate(n, seed=5_000_011)
    out = []
    for i in range(n):
        request = pb.ScoreRequest(
            request_id=f"s{i}",
            entity_id=data.entity_ids[i],
            features={k: float(v) for k, v in zip(FEATURE_NAMES, data.features[i], strict=True)},
            history=[pb.HistoryRow(values=row.tolist()) for row in data.histories[i][:32]],
        )
        out.append(request.SerializeToString())
    return out


async def _open_loop(
    target: str, payloads: list[bytes], rate_rps: float, duration_s: float, on_start
):
    rng = np.random.default_rng(7)
    offsets = np.cumsum(rng.exponential(1.0 / rate_rps, int(rate_rps * duration_s * 1.2)))
    offsets = offsets[offsets < duration_s]
    latencies: list[float] = []
    errors: dict[str, int] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary("/riskscoring.v1.RiskScoring/Score")
        for payload in payloads[:WARMUP_REQUESTS]:
            await call(payload, timeout=5)
        await asyncio.sleep(3.0)  # the shadow worker has loaded its engine at idle priority
        on_start()
        start = time.perf_counter() + 0.1

        async def one(i: int, at: float) -> None:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                await call(payloads[i % len(payloads)], timeout=5)
                latencies.append(time.perf_counter() - (start + at))
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1

        await asyncio.gather(*(one(i, float(at)) for i, at in enumerate(offsets)))
    return np.array(latencies) * 1e3, errors, len(offsets)


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
        if "service.shadow.worker" in (process.info["cmdline"] or ()):
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
        arms = {"champion": "1", "challengers": [version], "mode": "shadow"}
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
        before = []
        stopped = 0

        def on_start() -> None:
            nonlocal stopped
            if config.stop_worker:
                stopped = _signal_workers(signal.SIGSTOP)
                if not stopped:
                    raise RuntimeError(f"{name}: no shadow worker to stop")
            before.extend((server.cpu_seconds(), _worker_cpu_s()))

        try:
            ms, errors, sent = asyncio.run(
                _open_loop(server.target, payloads, rate, args.duration_s, on_start)
            )
        finally:
            if stopped:
                _signal_workers(signal.SIGCONT)
        cpu, worker_cpu = server.cpu_seconds() - before[0], _worker_cpu_s() - before[1]
        time.sleep(1.5)  # the drop metric is published once a second
        dropped = _drops(metrics_port)
    logged, challenger_ms = _challenger_rows(logs)
    p50, p99 = np.percentile(ms, [50, 99])
    return dict(
        config=name, rate=rate, sent=sent, ok=len(ms), errors=errors, p50=p50, p99=p99,
        cpu=cpu, worker_cpu=worker_cpu, logged=logged, dropped=dropped,
        challenger_ms=challenger_ms,
    )  # fmt: skip


def sweep(args: argparse.Namespace) -> int:
    payloads = _requests(500)
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
          f"{WARMUP_REQUESTS} warm-up")  # fmt: skip
    print(
        "rate | config | run | sent | ok | errors | p50 ms | p99 ms | p99 vs none | server CPU s "
        "| worker CPU s (both during the load) | copies logged | copies dropped "
        "| challenger engine ms (median)"
    )
    for r in runs:
        # `--only` may leave out the baseline: then there is nothing to compare with.
        baseline = PINNED_BASELINE if CONFIGS[r["config"]].server_on_cpu0 else BASELINE
        base = next(
            (b["p99"] for b in runs
             if b["config"] == baseline and b["rate"] == r["rate"]
             and b["repeat"] == r["repeat"]),
            None,
        )  # fmt: skip
        shadow = r["config"] != baseline
        delta = f"{r['p99'] - base:+.2f}" if shadow and base is not None else "-"
        copies = (
            f"{r['logged']} | {r['dropped']} | {r['challenger_ms']:.2f}" if shadow else "- | - | -"
        )
        print(
            f"{r['rate']:g} | {r['config']} | {r['repeat']} | {r['sent']} | {r['ok']} | "
            f"{r['errors'] or '-'} | {r['p50']:.2f} | {r['p99']:.2f} | {delta} | "
            f"{r['cpu']:.1f} | {r['worker_cpu']:.1f} | {copies}"
        )
    return 0


def _demo_jobs(n: int) -> list:
    """Makers of one-row jobs shaped as a Score request's validated inputs (history 32 rows)."""
    from service.shadow import ShadowJob

    data = generate(n, seed=5_000_011)

    def maker(i: int):
        history = np.asarray(data.histories[i][:32], dtype=np.float32)[None]
        inputs = {
            "features": np.asarray(data.features[i : i + 1], dtype=np.float32),
            "history": history,
            "history_mask": np.ones(history.shape[:2], dtype=np.float32),
        }
        return lambda: ShadowJob(
            model="fraud-demo", experiment="fraud-demo", versions=("2",), request_ids=(f"m{i}",),
            entity_ids=("e",), inputs=inputs, champion_scores=np.zeros(1, np.float32),
            champion_version="1",
        )  # fmt: skip

    return [maker(i) for i in range(n)]


async def _micro(jobs: int) -> None:
    from service.shadow import ShadowRunner

    makers = _demo_jobs(jobs)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        _copy_demo(root, "1")
        _copy_demo(root, "2")
        runner = ShadowRunner(
            lambda model, version: root / model / version,
            str(Path(tmp) / "logs"),
            replica_id="micro",
            max_queued_jobs=jobs + 1,
        )
        runner.start()
        while runner.worker_pid is None:
            await asyncio.sleep(0.05)
        accepted = []
        for make in makers:  # one job per loop turn, as requests arrive
            started = time.perf_counter_ns()
            runner.submit(make())
            accepted.append(time.perf_counter_ns() - started)
            await asyncio.sleep(0)
        await runner.close(timeout_s=120)
        assert runner.full and runner.completed == jobs
        dropped = []
        for _ in range(100_000):  # the full-queue path of Experiments.record
            started = time.perf_counter_ns()
            if runner.full:
                runner.drop("fraud-demo")
            dropped.append(time.perf_counter_ns() - started)
    for name, ns in (("accepted (ShadowJob + submit)", accepted), ("dropped (full)", dropped)):
        p50, p99 = np.percentile(np.array(ns) / 1e3, [50, 99])
        print(f"{name}: median {p50:.2f} µs, p99 {p99:.2f} µs over {len(ns)} jobs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=floats, default=[100.0, 300.0], help="req/s, comma list")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", action="append", choices=list(CONFIGS), help="configs to run")
    parser.add_argument("--micro", action="store_true", help="time submit and drop in-process")
    parser.add_argument("--jobs", type=int, default=2000, help="jobs for --micro")
    args = parser.parse_args(argv)
    if args.micro:
        asyncio.run(_micro(args.jobs))
        return 0
    return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
