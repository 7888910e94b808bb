"""What shadow mode costs the champion: p50/p99 of Score with no experiment, with a challenger
scoring a shadow copy of every request, and with a shadow queue of a single job (copies
beyond it are dropped and counted).

The challenger is a copy of the demo model under version 2 (the same cost as the champion, the
worst case for a challenger of the same size). Load: open-loop Poisson arrivals of Score
requests at a fixed rate, latency from each request's scheduled send time.

    .venv/bin/python -m bench.shadow_overhead --rate-rps 100 --duration-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from bench.servers import ServerProcess, ServerSpec, free_port
from demo.generator import FEATURE_NAMES, generate
from riskscoring.v1 import risk_scoring_pb2 as pb

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "fraud-demo" / "1"


def _models(root: Path) -> Path:
    for version in ("1", "2"):
        target = root / "fraud-demo" / version
        target.mkdir(parents=True)
        for name in ("model.onnx", "manifest.json"):
            shutil.copy(DEMO / name, target / name)
        manifest = json.loads((target / "manifest.json").read_text())
        manifest.update(version=version, variants={})
        (target / "manifest.json").write_text(json.dumps(manifest))
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


async def _open_loop(target: str, payloads: list[bytes], rate_rps: float, duration_s: float):
    rng = np.random.default_rng(7)
    offsets = np.cumsum(rng.exponential(1.0 / rate_rps, int(rate_rps * duration_s * 1.2)))
    offsets = offsets[offsets < duration_s]
    latencies: list[float] = []
    errors: dict[str, int] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary("/riskscoring.v1.RiskScoring/Score")
        for payload in payloads[:50]:  # warm up
            await call(payload, timeout=5)
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


def _shadow_rows(prefix: Path) -> int:
    """Challenger rows the server logged (the rest of the shadow copies were dropped)."""
    from service.shadow import read_records

    if not prefix.exists():
        return 0
    table = read_records(str(prefix))
    return sum(1 for served in table.column("served").to_pylist() if not served)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-rps", type=float, default=100.0)
    parser.add_argument("--duration-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    payloads = _requests(500)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = _models(Path(tmp) / "models")
        experiments = Path(tmp) / "experiments.json"
        experiments.write_text(
            json.dumps(
                {
                    "models": {
                        "fraud-demo": {"champion": "1", "challengers": ["2"], "mode": "shadow"}
                    }
                }
            )
        )
        configs = {
            "no experiment": {},
            "shadow, every request": {"RISKSERVE_EXPERIMENTS_FILE": str(experiments)},
            "shadow, queue of one job": {
                "RISKSERVE_EXPERIMENTS_FILE": str(experiments),
                "RISKSERVE_SHADOW_MAX_QUEUED_JOBS": "1",
            },
        }
        for name, env in configs.items():
            port = free_port()
            spec = ServerSpec(
                name=name,
                argv=(str(REPO / ".venv" / "bin" / "riskserve"), "serve", "--port", str(port)),
                grpc_port=port,
                model_name="fraud-demo",
                env={
                    "RISKSERVE_MODELS_DIR": str(root),
                    "RISKSERVE_METRICS_PORT": "none",
                    "RISKSERVE_TRACE_FILE": "none",
                    "RISKSERVE_BUDGET_MS": "1000",
                    "RISKSERVE_SHADOW_LOG_PREFIX": str(Path(tmp) / "logs" / str(port)),
                    **env,
                },
                cwd=REPO,
            )
            log = REPO / "bench" / "results" / f"shadow_overhead_{port}.log"
            with ServerProcess(spec, log) as server:
                ms, errors, sent = asyncio.run(
                    _open_loop(server.target, payloads, args.rate_rps, args.duration_s)
                )
                cpu = server.cpu_seconds()
            shadowed = _shadow_rows(Path(tmp) / "logs" / str(port))
            rows.append((name, sent, len(ms), errors, *np.percentile(ms, [50, 99]), cpu, shadowed))
    print(f"rate {args.rate_rps:g} req/s for {args.duration_s:g} s, Score, history <= 32 rows")
    print("config | sent | ok | errors | p50 ms | p99 ms | server CPU s | challenger rows logged")
    for name, sent, ok, errors, p50, p99, cpu, shadowed in rows:
        print(
            f"{name} | {sent} | {ok} | {errors or '-'} | {p50:.2f} | {p99:.2f} | {cpu:.1f} | "
            f"{shadowed}"
        )
    base = rows[0][5]
    for name, *_, p99, _cpu, _shadowed in rows[1:]:
        print(f"p99 {name} - no experiment: {p99 - base:+.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
