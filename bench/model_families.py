"""Engine time per row of each classifier family beside the demo model's.

Every family of `demo.families` (logistic regression, random forest and gradient boosting from
scikit-learn; LightGBM; XGBoost; CatBoost) is trained on generated data, exported to ONNX as its
library documents, and written as a riskserve model folder: the ``[N, K]`` tensor export, and
the ZipMap export where the converter has one (the server fetches the tensor the ZipMap is made
from, so both should cost the same). The demo model is ``models/fraud-demo/1``, fed real
generator rows with histories of exactly ``--history-length`` rows.

Each model gets the engine the server builds (`OnnxRuntimeEngine.from_model_dir` with its
resolved `ScoreOutput`, ONNX Runtime on the CPU, one intra-op thread: the server's default
``engine_threads``). One call is ``engine.infer`` plus ``score.scores``, on held-out rows, a
different slice each call. After ``--warmup`` calls, ``--repetitions`` timed calls
(``time.perf_counter``) at each batch size give the median and p90 of one call, the median per
row, and that per row against the demo model's at the same batch. ``ONNX KiB`` is the size of
``model.onnx``. Nothing is pinned here; on a shared machine pin the process yourself::

    taskset -c 0 .venv/bin/python -m bench.model_families --batches 1,16,64 --repetitions 1000
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.model_io import DEMO_MODEL_PATH
from demo.families import EXPORTS, dataset, export, write_version
from demo.generator import generate, pad_histories
from engines.manifest import load_manifest
from engines.onnxrt.engine import OnnxRuntimeEngine
from engines.onnxrt.loader import CPU
from engines.output import resolve_score_output

Feed = dict[str, np.ndarray]
DEMO = "fraud-demo"
DEMO_SEED = 5_000_023  # a generator seed that demo.train never uses
DEMO_ROWS = 256  # generator rows whose histories are cut to --history-length
FAMILIES = tuple(dict.fromkeys(family for family, _ in EXPORTS))


@dataclass(frozen=True)
class Case:
    """One model folder to time, and how to make its feed of `batch` rows starting at a row."""

    model: str
    output: str  # "tensor" or "ZipMap": the kind of the manifest's probability output
    model_dir: Path
    rows: int
    feed: Callable[[int, int], Feed]


@dataclass(frozen=True)
class Row:
    model: str
    output: str
    onnx_kib: float
    batch: int
    p50_us: float
    p90_us: float

    @property
    def p50_per_row_us(self) -> float:
        return self.p50_us / self.batch


def family_cases(families: list[str], root: Path) -> list[Case]:
    """The exports of `families` under `root`, tensor before ZipMap, fed held-out rows."""
    _, _, held_out = dataset()
    cases = []
    for family, zipmap in sorted(EXPORTS, key=lambda e: (FAMILIES.index(e[0]), e[1])):
        if family not in families:
            continue
        exported = export(family, zipmap, root / "work" / f"{family}-{zipmap}")
        name = f"{family}-zipmap" if zipmap else family
        folder = write_version(exported, root / "models", name)
        output = "ZipMap" if zipmap else "tensor"
        feed = _slices({exported.input_name: held_out})
        cases.append(Case(family, output, folder, len(held_out), feed))
    return cases


def _slices(arrays: Feed) -> Callable[[int, int], Feed]:
    def feed(start: int, batch: int) -> Feed:
        return {name: array[start : start + batch] for name, array in arrays.items()}

    return feed


def demo_case(history_length: int) -> Case:
    """The demo model, fed generator rows whose histories are cut to `history_length` rows."""
    model_dir = DEMO_MODEL_PATH.parent
    manifest = load_manifest(model_dir)
    assert manifest.history is not None
    data = generate(DEMO_ROWS * 4, DEMO_SEED)
    keep = [i for i, h in enumerate(data.histories) if len(h) >= history_length][:DEMO_ROWS]
    history, mask = pad_histories([data.histories[i][-history_length:] for i in keep])
    feed = _slices(
        {
            manifest.features_input: data.features[keep],
            manifest.history.input: history,
            manifest.history.mask_input: mask,
        }
    )
    return Case(DEMO, "tensor", model_dir, len(keep), feed)


def time_case(case: Case, batches: list[int], warmup: int, repetitions: int) -> list[Row]:
    """Time one call (`engine.infer` and the scores) at each batch size, as the server runs it."""
    manifest = load_manifest(case.model_dir)
    score = resolve_score_output(case.model_dir / "model.onnx", manifest)
    engine = OnnxRuntimeEngine.from_model_dir(
        case.model_dir, manifest, providers=(CPU,), intra_op_threads=1, score=score
    )
    onnx_kib = (case.model_dir / "model.onnx").stat().st_size / 1024
    rows = []
    for batch in batches:
        if batch > case.rows:
            raise SystemExit(f"{case.model}: batch {batch} is more than its {case.rows} rows")
        # A different slice each call: one batch run again and again goes 2 to 3 times faster
        # through a tree ensemble, whose branches the CPU then predicts.
        feeds = [case.feed(start, batch) for start in range(0, case.rows - batch + 1, batch)]
        for i in range(warmup):
            score.scores(engine.infer(feeds[i % len(feeds)]))
        times_us = np.empty(repetitions)
        for i in range(repetitions):
            feed = feeds[i % len(feeds)]
            started = time.perf_counter()
            score.scores(engine.infer(feed))
            times_us[i] = (time.perf_counter() - started) * 1e6
        p50, p90 = np.percentile(times_us, [50, 90])
        rows.append(Row(case.model, case.output, onnx_kib, batch, float(p50), float(p90)))
    engine.close()
    return rows


def table(rows: list[Row]) -> str:
    """A Markdown table, one line per model and batch; per row also against the demo model's."""
    demo = {r.batch: r.p50_per_row_us for r in rows if r.model == DEMO}
    lines = [
        "| model | output | ONNX KiB | batch | p50 µs/call | p90 µs/call | p50 µs/row "
        "| per row vs demo |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r.p50_per_row_us / demo[r.batch]:.3f}x" if r.batch in demo else ""
        lines.append(
            f"| {r.model} | {r.output} | {r.onnx_kib:.1f} | {r.batch} | {r.p50_us:.1f} "
            f"| {r.p90_us:.1f} | {r.p50_per_row_us:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def _machine() -> str:
    import onnxruntime as ort

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    now = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs ({usable} usable by this process), "
        f"onnxruntime {ort.__version__}, load average {os.getloadavg()[0]:.2f}, {now}"
    )


def _families(value: str) -> list[str]:
    names = [n for n in value.split(",") if n]
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; families are {', '.join(FAMILIES)}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64", help="batch sizes, comma-separated")
    parser.add_argument("--repetitions", type=int, default=1000, help="timed calls a batch size")
    parser.add_argument("--warmup", type=int, default=100, help="untimed calls before them")
    parser.add_argument(
        "--families", type=_families, default=list(FAMILIES), help="comma-separated"
    )
    parser.add_argument("--history-length", type=int, default=32, help="the demo's history rows")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    print(_machine())
    print(
        f"ONNX Runtime on the CPU, 1 intra-op thread; one call is engine.infer + score.scores; "
        f"{args.repetitions} timed calls after {args.warmup} warm-up ones; demo history "
        f"{args.history_length} rows"
    )
    rows = time_case(demo_case(args.history_length), batches, args.warmup, args.repetitions)
    with tempfile.TemporaryDirectory() as tmp:
        for case in family_cases(args.families, Path(tmp)):
            rows += time_case(case, batches, args.warmup, args.repetitions)
    print(table(rows))


if __name__ == "__main__":
    main()
