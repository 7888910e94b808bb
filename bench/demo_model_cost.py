"""Quality and CPU cost of the committed `fraud-demo` model under ONNX Runtime.

Prints the held-out AUC on fresh generator data (a seed training never uses), then the median
(and p90) time of one ``session.run`` at each batch size, with histories of exactly
``--history-length`` rows, for each ``intra_op_num_threads`` setting::

    .venv/bin/python -m bench.demo_model_cost --threads 1,2 --batches 1,64 --history-length 32
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

from demo.generator import generate, pad_histories

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "fraud-demo" / "1"
HELD_OUT_SEED = 5_000_011  # demo.train --seed 0 uses 0, 1_000_003 and 2_000_003


def _session(threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(
        str(MODEL_DIR / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )


def held_out_auc(n: int) -> float:
    from sklearn.metrics import roc_auc_score

    data = generate(n, HELD_OUT_SEED)
    session = _session(threads=2)
    order = np.argsort([len(h) for h in data.histories], kind="stable")
    scores = np.empty(n, np.float32)
    for start in range(0, n, 512):
        idx = order[start : start + 512]
        history, mask = pad_histories([data.histories[i] for i in idx])
        feed = {"features": data.features[idx], "history": history, "history_mask": mask}
        scores[idx] = session.run(["score"], feed)[0][:, 0]
    return float(roc_auc_score(data.labels, scores))


def _feed(batch: int, history_length: int) -> dict[str, np.ndarray]:
    """Real generator rows with at least ``history_length`` rows, cut to their last ones."""
    data = generate(batch * 8, HELD_OUT_SEED + 1)
    keep = [i for i, h in enumerate(data.histories) if len(h) >= history_length][:batch]
    if len(keep) < batch:
        raise SystemExit(f"too few histories of {history_length} rows for batch {batch}")
    history, mask = pad_histories([data.histories[i][-history_length:] for i in keep])
    return {"features": data.features[keep], "history": history, "history_mask": mask}


def time_calls_ms(session, feed: dict[str, np.ndarray], runs: int) -> np.ndarray:
    for _ in range(max(runs // 10, 20)):
        session.run(["score"], feed)
    times_ms = np.empty(runs)
    for i in range(runs):
        started = time.perf_counter_ns()
        session.run(["score"], feed)
        times_ms[i] = (time.perf_counter_ns() - started) / 1e6
    return times_ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="intra_op_num_threads values")
    parser.add_argument("--batches", default="1,64", help="batch sizes")
    parser.add_argument("--history-length", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2000, help="timed calls at batch 1")
    parser.add_argument("--auc-rows", type=int, default=20_000)
    args = parser.parse_args(argv)

    import onnxruntime as ort

    print(
        f"onnxruntime {ort.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"held-out AUC {held_out_auc(args.auc_rows):.4f} "
        f"({args.auc_rows} rows, seed {HELD_OUT_SEED})"
    )
    load_1m = os.getloadavg()[0]
    print(f"history length {args.history_length}; times of one session.run, ms; load {load_1m:.2f}")
    print(f"{'threads':>7} {'batch':>5} {'runs':>5} {'p50/call':>9} {'p90/call':>9} {'p50/row':>8}")
    batches = [int(b) for b in args.batches.split(",")]
    per_row_us: dict[int, list[float]] = {}
    for threads in (int(t) for t in args.threads.split(",")):
        session = _session(threads)
        per_row_us[threads] = []
        for batch in batches:
            feed = _feed(batch, args.history_length)
            runs = max(args.runs // batch, 200)
            times_ms = time_calls_ms(session, feed, runs)
            p50, p90 = np.percentile(times_ms, [50, 90])
            print(f"{threads:>7} {batch:>5} {runs:>5} {p50:>9.3f} {p90:>9.3f} {p50 / batch:>8.4f}")
            per_row_us[threads].append(p50 / batch * 1e3)
    print("\nµs per row: the p50 of one call divided by its rows")
    print("| intra-op threads | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for threads, values in per_row_us.items():
        print(f"| {threads} | " + " | ".join(f"{v:.0f}" for v in values) + " |")


if __name__ == "__main__":
    main()
