"""How long `riskserve shadow-report` takes, and how much memory, at a card issuer's volume.

Generates a shadow experiment's log in the real schema with the real writer (numpy columns ->
`columns_to_table` -> the log's `PartitionWriter`, rolling 128 MB files in the Hive layout):
half the records are the champion's (served), half the challenger's, one per request, 2 %
positives, entities that repeat (10 records per entity on average), champion and challenger
scores correlated about 0.72, one day of timestamps; and a labels file keyed by request id.
The data is cached under bench/results/shadow-report/. Each size's report runs in a fresh
process (labels, entity-level analytic intervals, thresholds from the scores) and the table
gives wall time, CPU time and peak RSS. `--verify` checks, at the sizes up to
`--verify-max`, every figure against scikit-learn and SciPy on the same data.

`--log` instead measures what the log's flush interval costs the serving process: the CPU
its flusher thread spends per second at 2,000 records a second, per interval.

    .venv/bin/python -m bench.shadow_report --sizes 1e6,1e7,5e7 --verify
    .venv/bin/python -m bench.shadow_report --log
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from engines.manifest import Thresholds
from service.shadow.log import PartitionWriter
from service.shadow.record import ExperimentRecord, columns_to_table

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "bench" / "results" / "shadow-report"
THRESHOLDS = Thresholds(review=0.5, decline=0.8)
DAY_START_NS = 1_780_000_000 * 10**9  # a fixed UTC day, so cached data never moves
CHUNK_REQUESTS = 2_000_000
RECORDS_PER_ENTITY = 10
NOISE = 0.62  # corr(latent + e1, latent + e2) = 1 / (1 + NOISE**2) ~ 0.72
POSITIVE_SHIFT = -5.2  # about 2 % positives


def _strings(prefix: str, numbers: np.ndarray, width: int) -> pa.Array:
    digits = pc.utf8_lpad(pc.cast(pa.array(numbers), pa.string()), width, "0")
    return pc.binary_join_element_wise(prefix, digits, "")


def _constant(value: str, n: int) -> pa.Array:
    return pa.DictionaryArray.from_arrays(np.zeros(n, np.int8), [value]).cast(pa.string())


def _decisions(scores: np.ndarray) -> pa.Array:
    codes = (scores >= THRESHOLDS.review).astype(np.int8) + (scores >= THRESHOLDS.decline)
    return pa.DictionaryArray.from_arrays(codes, ["APPROVE", "REVIEW", "DECLINE"]).cast(pa.string())


def _arm(
    arm: str, version: str, ids: pa.Array, entities: pa.Array, times: np.ndarray,
    scores: np.ndarray, latency_ms: np.ndarray, replica: str,
) -> pa.Table:  # fmt: skip
    n = len(scores)
    return columns_to_table({
        "request_id": ids, "entity_id": entities,
        "time": pa.array(times, pa.timestamp("ns", tz="UTC")),
        "experiment": _constant("card-fraud", n), "model": _constant("card-fraud", n),
        "arm": _constant(arm, n), "version": _constant(version, n), "score": scores,
        "decision": _decisions(scores), "engine": _constant("onnxruntime-cpu", n),
        "latency_ms": latency_ms, "mode": _constant("shadow", n),
        "served": np.full(n, arm == "champion"), "replica_id": _constant(replica, n),
    })  # fmt: skip


def generate(records: int, folder: Path, seed: int = 7) -> None:
    """`records` experiment records (two per request) and the labels, under `folder`."""
    requests = records // 2
    entities = max(1, 2 * requests // RECORDS_PER_ENTITY)
    rng = np.random.default_rng(seed)
    entity_risk = rng.normal(scale=0.5, size=entities)
    fs = pafs.LocalFileSystem()
    writers = {
        arm: PartitionWriter(fs, str(folder / "logs"), folder / "logs" / "_spool", replica)
        for arm, replica in (("champion", "server-0"), ("challenger", "shadow-worker-0"))
    }
    labels_writer = None
    step_ns = 86_400 * 10**9 // requests
    for start in range(0, requests, CHUNK_REQUESTS):
        n = min(CHUNK_REQUESTS, requests - start)
        number = np.arange(start, start + n)
        entity = rng.integers(0, entities, size=n)
        latent = rng.normal(size=n) + entity_risk[entity]
        label = rng.random(n) < 1 / (1 + np.exp(-(2.0 * latent + POSITIVE_SHIFT)))
        ids, entity_ids = _strings("req-", number, 12), _strings("card-", entity, 10)
        times = DAY_START_NS + number * step_ns
        for arm, version in (("champion", "1"), ("challenger", "2")):
            scores = 1 / (1 + np.exp(-(latent + rng.normal(scale=NOISE, size=n))))
            base_ms = 2.0 if arm == "champion" else 0.4
            latency = rng.lognormal(np.log(base_ms), 0.3, size=n)
            writer = writers[arm]
            writer.append(_arm(arm, version, ids, entity_ids, times, scores, latency,
                               writer.replica_id))  # fmt: skip
        table = pa.table({"request_id": ids, "label": pa.array(label.astype(np.int8))})
        if labels_writer is None:
            labels_writer = pq.ParquetWriter(folder / "labels.parquet", table.schema)
        labels_writer.write_table(table, row_group_size=1_000_000)
    for writer in writers.values():
        writer.roll_all()
    if labels_writer is not None:
        labels_writer.close()


def dataset(records: int) -> Path:
    folder = CACHE / f"records-{records}"
    if not (folder / "complete").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        started = time.monotonic()
        generate(records, folder)
        (folder / "complete").write_text(f"{time.monotonic() - started:.1f}\n")
    return folder


def run_one(records: int, verify: bool) -> dict[str, object]:
    """In this process: the report at one size; wall, CPU and peak RSS (and the checks)."""
    from riskreport import build_report
    from riskreport.html import render_html

    folder = dataset(records)
    cpu, wall = time.process_time(), time.monotonic()
    report = build_report(
        str(folder / "logs"), labels_path=str(folder / "labels.parquet"),
        thresholds=THRESHOLDS, memory_limit="1GB",
    )  # fmt: skip
    html_bytes = len(render_html(report).encode())
    result: dict[str, object] = {
        "records": report.records,
        "files": len(list((folder / "logs").rglob("*.parquet"))),
        "wall_s": time.monotonic() - wall,
        "cpu_s": time.process_time() - cpu,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "entities": report.arms[0].labels.entities if report.arms[0].labels else 0,
        "html_kb": html_bytes / 1000,
        "auc": [a.labels.auc.estimate for a in report.arms if a.labels],
        "auc_difference": report.comparisons[0].auc_difference.__repr__(),
    }
    if verify:
        result["max_error"] = check(folder, report)
    return result


def check(folder: Path, report: object) -> dict[str, float]:
    """Largest absolute difference of each figure from scikit-learn / SciPy on the same data."""
    from scipy import stats
    from sklearn.metrics import roc_auc_score

    table = pq.read_table(folder / "logs", columns=["request_id", "arm", "score"],
                          partitioning=None)  # fmt: skip
    labels = pq.read_table(folder / "labels.parquet")
    joined = table.join(labels, "request_id")
    arms = {}
    for arm in ("champion", "challenger"):
        part = joined.filter(pc.equal(joined.column("arm"), arm)).sort_by("request_id")
        arms[arm] = (part.column("score").to_numpy(), part.column("label").to_numpy())
    (a, y), (b, _) = arms["champion"], arms["challenger"]
    r = report  # a Report
    c = r.comparisons[0]  # type: ignore[attr-defined]
    edges = np.quantile(a, np.linspace(0, 1, 11)[1:-1])
    e = np.histogram(a, np.r_[-np.inf, edges, np.inf])[0] / len(a)
    s = np.histogram(b, np.r_[-np.inf, edges, np.inf])[0] / len(b)
    ks = stats.ks_2samp(a, b, method="asymp")
    return {
        "auc": max(
            abs(r.arms[0].labels.auc.estimate - roc_auc_score(y, a)),  # type: ignore[attr-defined]
            abs(r.arms[1].labels.auc.estimate - roc_auc_score(y, b)),  # type: ignore[attr-defined]
        ),
        "psi": abs(c.psi - float(np.sum((s - e) * np.log(s / e)))),
        "ks": abs(c.ks_statistic - ks.statistic),
        "ks_p": abs(c.ks_pvalue - ks.pvalue),
        "pearson": abs(c.pearson - stats.pearsonr(a, b).statistic),
        "spearman": abs(c.spearman - stats.spearmanr(a, b).statistic),
    }


def log_cost(intervals: list[float], seconds: float, rate: int) -> list[dict[str, float]]:
    """CPU of the flusher thread per second of traffic at `rate` records/s, per interval."""
    from service.shadow.log import ExperimentLog

    rows = []
    template = ExperimentRecord(
        request_id="", entity_id="card-0000000001", experiment="card-fraud", model="card-fraud",
        arm="champion", version="1", score=0.1, decision="APPROVE", engine="onnxruntime-cpu",
        latency_ms=1.9, mode="shadow", served=True,
    )  # fmt: skip
    for interval in intervals:
        with tempfile.TemporaryDirectory() as folder:
            log = ExperimentLog(folder, replica_id="bench", flush_interval_s=interval).start()
            assert log._thread is not None
            native = log._thread.native_id
            assert native is not None

            def flusher_cpu(native: int = native) -> float:
                for t in psutil.Process().threads():
                    if t.id == native:
                        return t.user_time + t.system_time
                return 0.0

            before, started, sent = flusher_cpu(), time.monotonic(), 0
            while (elapsed := time.monotonic() - started) < seconds:
                due = int(elapsed * rate)
                for i in range(sent, due):
                    log.log(replace(template, request_id=f"r{i}"))
                sent = due
                time.sleep(0.005)
            used = flusher_cpu() - before
            log.close()
            rows.append({"interval_s": interval, "flusher_cpu_ms_per_s": 1000 * used / seconds,
                         "records": sent, "worst_loss_records": rate * interval})  # fmt: skip
    return rows


REPORT_HEADER = (
    "| records | files | entities | wall s | CPU s | peak RSS GB | HTML KB "
    "| largest difference from scikit-learn / SciPy |\n|---|---|---|---|---|---|---|---|"
)
LOG_HEADER = (
    "| flush interval s | flusher CPU ms per s at 2,000 rec/s | worst loss on kill -9, records |"
    "\n|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1e6,1e7,5e7", help="record counts, comma-separated")
    parser.add_argument("--verify", action="store_true", help="check figures against sklearn")
    parser.add_argument("--verify-max", type=float, default=1e7, help="largest size checked")
    parser.add_argument("--one", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--log", action="store_true", help="the log's flush-interval cost")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(int(args.one), args.verify)))
        return
    if args.log:
        print(LOG_HEADER)
        for row in log_cost([1.0, 0.5, 0.2, 0.1, 0.05], seconds=8.0, rate=2000):
            print(f"| {row['interval_s']} | {row['flusher_cpu_ms_per_s']:.2f} | "
                  f"{row['worst_loss_records']:.0f} |")  # fmt: skip
        return
    print(REPORT_HEADER)
    for size in (int(float(s)) for s in args.sizes.split(",")):
        dataset(size)  # generated (or found) before the timed process starts
        command = [sys.executable, "-m", "bench.shadow_report", "--one", str(size)]
        if args.verify and size <= args.verify_max:
            command.append("--verify")
        out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        errors = row.get("max_error")
        shown = ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) if errors else "not checked"
        print(f"| {row['records']:,} | {row['files']} | {row['entities']:,} "
              f"| {row['wall_s']:.1f} | {row['cpu_s']:.1f} | {row['peak_rss_gb']:.2f} "
              f"| {row['html_kb']:.0f} | {shown} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
