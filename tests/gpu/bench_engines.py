"""GPU benchmark: TensorRT FP16/INT8 vs ONNX Runtime (CUDA where installed, else CPU) per batch.

    python tests/gpu/bench_engines.py models/fraud-demo/1 OUT_DIR

Writes engines-bench.json and engines-bench.md in OUT_DIR. Each figure is the median and p99 of
`repeats` timed calls after warm-up, measured on the host's monotonic clock around `infer()`
(host-to-device copies and synchronisation included).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from engines.base import Engine, ShapeMismatch
from engines.manifest import load_manifest
from engines.onnxrt import OnnxRuntimeEngine, available_providers
from engines.pool import EnginePool

BATCHES = (1, 8, 32, 64, 128, 256)


def _time(engine: Engine | EnginePool, inputs: dict, repeats: int) -> tuple[float, float]:
    run = engine.run if isinstance(engine, EnginePool) else engine.infer
    for _ in range(10):
        run(inputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(inputs)
        times.append(time.perf_counter() - start)
    ms = np.array(times) * 1e3
    return float(np.median(ms)), float(np.percentile(ms, 99))


def main(model_dir: Path, out_dir: Path, repeats: int = 200) -> int:
    from demo.generator import generate, model_inputs
    from engines.trt import load_engines

    manifest = load_manifest(model_dir)
    accepted = {"fp32": model_dir / "model.onnx"}
    accepted |= {p: model_dir / f for p, f in manifest.variants.items()}
    trt_engines = load_engines(model_dir, accepted, ["fp16", "int8"])
    providers = available_providers()
    ort_engines: list[Engine] = [OnnxRuntimeEngine.from_model_dir(model_dir, manifest)]
    data = model_inputs(generate(max(BATCHES), seed=4242))
    rows = []
    for size in BATCHES:
        batch = {k: np.ascontiguousarray(v[:size]) for k, v in data.items()}
        for engine in [*trt_engines, *ort_engines]:
            try:
                median, p99 = _time(engine, batch, repeats)
            except ShapeMismatch as exc:
                rows.append({"engine": engine.name, "batch": size, "skipped": str(exc)})
                continue
            rows.append({"engine": engine.name, "batch": size, "median_ms": median, "p99_ms": p99})
    # The fallback path: a batch one row longer than the TensorRT profile goes through the pool.
    if trt_engines and manifest.history:
        spec = manifest.profiles[trt_engines[0].precision][0]
        if spec.history_length:
            long_len = spec.history_length[2] + 16
            batch = {k: np.ascontiguousarray(v[:32]) for k, v in data.items()}
            for name in (manifest.history.input, manifest.history.mask_input):
                arr = batch[name][:, : min(batch[name].shape[1], long_len)]
                pad = [(0, 0), (0, long_len - arr.shape[1])] + [(0, 0)] * (arr.ndim - 2)
                batch[name] = np.pad(arr, pad)
            batch[manifest.history.mask_input][0, :] = 1.0
            pool = EnginePool.for_manifest(manifest, trt_engines, ort_engines[0])
            median, p99 = _time(pool, batch, repeats)
            result = pool.run(batch)
            rows.append(
                {
                    "engine": "pool(split by row)",
                    "batch": 32,
                    "median_ms": median,
                    "p99_ms": p99,
                    "fallback_reason": result.fallback_reason,
                }
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"providers": list(providers), "repeats": repeats, "rows": rows}
    (out_dir / "engines-bench.json").write_text(json.dumps(meta, indent=2))
    lines = ["| engine | batch | median ms | p99 ms |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        if "median_ms" in r:
            lines.append(
                f"| {r['engine']} | {r['batch']} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} |"
            )
        else:
            lines.append(f"| {r['engine']} | {r['batch']} | skipped | {r['skipped']} |")
    (out_dir / "engines-bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
