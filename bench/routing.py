"""What routing costs a request: `RequestRouter` per call, in-process, in CPU microseconds.

Two copies of the demo model are loaded as versions 1 and 2 (ONNX Runtime FP32, no warm-up
beyond one run). For each case the router is called `--calls` times in a loop on this thread
and the process CPU time per call is printed: one unary request without an experiment, in a
shadow experiment, and in an A/B split; and a 64-row batch (its entity ids already read) the
same three ways, where the A/B batch is grouped into its two arms. Routing runs on the event
loop, so this is time the loop spends per request before any decoding or scoring. CPU time,
not wall time, so other work on the machine changes the figures less.

    .venv/bin/python -m bench.routing --calls 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from service.models.loader import VersionLoader, default_engines
from service.models.registry import ModelRegistry
from service.models.routing import RequestRouter
from service.shadow import ExperimentConfig, ExperimentRouter

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "fraud-demo" / "1"
MODEL = "fraud-demo"
BATCH_ROWS = 64


class _Experiments:
    """What the router reads of `service.models.experiments.Experiments`: no log, no worker."""

    def __init__(self, config: dict) -> None:
        self.router = ExperimentRouter(ExperimentConfig.model_validate(config))
        self.route = self.router.route

    def record(self, *args: object) -> None:
        return None


def _models(root: Path) -> Path:
    for version in ("1", "2"):
        folder = root / MODEL / version
        folder.mkdir(parents=True)
        shutil.copy(DEMO / "model.onnx", folder / "model.onnx")
        manifest = json.loads((DEMO / "manifest.json").read_text())
        manifest.update(version=version, variants={}, calibration=None)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return root


async def _registry(models_dir: Path) -> ModelRegistry:
    loader = VersionLoader(
        default_engines(1, 1, tensorrt=False, onnx_variants=False),
        max_batch_rows=BATCH_ROWS,
        max_queue_rows=1024,
        workers=1,
        max_queue_delay_s=0.0,
        warmup_iterations=1,
        degrade_on_deadline=False,
    )
    registry = ModelRegistry(ThreadPoolExecutor(max_workers=1), loader)
    await registry.load_dir(models_dir)
    return registry


def _cpu_us(call: Callable[[], object], calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - started) / calls * 1e6


async def measure(calls: int) -> list[tuple[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        registry = await _registry(_models(Path(tmp)))
        try:
            routers = {"none": RequestRouter(registry)}
            for mode, extra in (("shadow", {}), ("ab", {"ab_share": 0.5})):
                config = {MODEL: {"champion": "1", "challengers": ["2"], "mode": mode, **extra}}
                experiments = _Experiments({"models": config})
                routers[mode] = RequestRouter(registry, experiments)  # type: ignore[arg-type]
            entities = [f"acct-{i}" for i in range(BATCH_ROWS)]
            rows = []
            for name, router in routers.items():
                one = _cpu_us(lambda r=router: r.route_one(MODEL, "", "acct-7"), calls)
                batch = _cpu_us(
                    lambda r=router: r.route_rows(MODEL, "", entities), max(1, calls // 16)
                )
                rows += [(f"Score, {name}", one), (f"ScoreBatch {BATCH_ROWS} rows, {name}", batch)]
            return rows
        finally:
            await registry.close(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="router calls per case")
    args = parser.parse_args()
    rows = asyncio.run(measure(args.calls))
    print(f"{'case':<34} {'CPU us per request':>18}")
    for case, us in rows:
        print(f"{case:<34} {us:>18.2f}")


if __name__ == "__main__":
    main()
