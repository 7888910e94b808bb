"""Step-by-step precision check: FP32 -> FP16 -> INT8 on held-out data, all with ONNX Runtime.

Each variant is compared with FP32 on the same rows: largest and mean absolute score error,
AUC (labels given) and the share of decisions that change at the manifest's thresholds. The
manifest's tolerance decides; a variant that fails is refused and never loaded, as is one that
scores any row NaN or infinite, or whose measures are not finite, whatever the tolerance.

The report records the sha256 of every file it scored, ``model.onnx`` included. A variant is
accepted only while both its own file and ``model.onnx`` still have the recorded contents: a
``model.onnx`` replaced in place, or a variant rewritten, is unvalidated until the check runs
again, so a variant made from old weights never answers for new ones.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engines.manifest import Manifest, Tolerance, load_manifest
from engines.onnxrt.engine import OnnxRuntimeEngine
from engines.output import ScoreOutput, resolve_score_output
from engines.trt.plans import sha256_file

__all__ = [
    "REPORT_FILE",
    "ValidationReport",
    "VariantReport",
    "accepted_variants",
    "auc",
    "load_report",
    "validate_model",
    "write_report",
]

log = logging.getLogger(__name__)

REPORT_FILE = "validation.json"
FP32_FILE = "model.onnx"
#: FP32 first, then each reduced precision in the order it is checked
PRECISION_ORDER = ("fp32", "fp16", "int8")


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve by the rank-sum statistic, ties given their mean rank; NaN
    where a score is NaN."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    if np.isnan(scores).any():
        # A NaN has no rank; sorting would place it above every score.
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # Average rank over each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    for start, end in zip(starts, ends, strict=True):
        ranks[order[start:end]] = (start + end + 1) / 2.0
    rank_sum = ranks[labels].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


@dataclass(frozen=True, slots=True)
class VariantReport:
    """One precision's scores compared with FP32 on the same rows."""

    precision: str
    file: str
    #: the scored file's contents; None in a report written before hashes were recorded
    sha256: str | None
    max_abs_error: float
    mean_abs_error: float
    auc: float
    auc_drop: float
    flip_rate: float
    #: rows it scored NaN or infinite; 0 in a report written before they were counted
    non_finite_scores: int = 0

    def failures(self, tolerance: Tolerance) -> tuple[str, ...]:
        """Which limits this variant exceeds (empty when it passes)."""
        out = []
        if self.non_finite_scores:
            out.append(f"{self.non_finite_scores} scores are NaN or infinite")
        for name, value, limit in (
            ("max_abs_error", self.max_abs_error, tolerance.max_abs_error),
            ("mean_abs_error", self.mean_abs_error, None),
            ("auc", self.auc, None),
            ("auc_drop", self.auc_drop, tolerance.auc_drop),
            ("flip_rate", self.flip_rate, tolerance.flip_rate),
        ):
            # Checked first: every comparison with NaN is false, so NaN would pass any limit.
            if not math.isfinite(value):
                out.append(f"{name} is {value}, not a finite number")
            elif limit is not None and value > limit:
                out.append(f"{name} {value:.4g} > {limit:g}")
        return tuple(out)

    def passes(self, tolerance: Tolerance) -> bool:
        return not self.failures(tolerance)


@dataclass(frozen=True, slots=True)
class ValidationReport:
    """The whole check for one model version; `tolerance` is the manifest's."""

    model: str
    version: str
    rows: int
    tolerance: Tolerance
    variants: tuple[VariantReport, ...]

    def variant(self, precision: str) -> VariantReport:
        for v in self.variants:
            if v.precision == precision:
                return v
        raise KeyError(precision)

    def passes(self, precision: str) -> bool:
        return self.variant(precision).passes(self.tolerance)

    @property
    def onnx_sha256(self) -> str | None:
        """The sha256 of the ``model.onnx`` every variant was compared with, if recorded."""
        for v in self.variants:
            if v.precision == "fp32" and v.file == FP32_FILE:
                return v.sha256
        return None

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "version": self.version,
            "rows": self.rows,
            "tolerance": self.tolerance.model_dump(),
            "variants": [{**asdict(v), "passes": v.passes(self.tolerance)} for v in self.variants],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ValidationReport:
        data = json.loads(text)
        fields = VariantReport.__dataclass_fields__
        return cls(
            model=data["model"],
            version=data["version"],
            rows=int(data["rows"]),
            tolerance=Tolerance.model_validate(data["tolerance"]),
            variants=tuple(
                VariantReport(**{"sha256": None, **{k: v for k, v in item.items() if k in fields}})
                for item in data["variants"]
            ),
        )

    def to_table(self) -> str:
        head = (
            f"{'precision':<10}{'max_abs_err':>12}{'mean_abs_err':>13}{'AUC':>8}"
            f"{'AUC_drop':>10}{'flip_rate':>10}  verdict"
        )
        lines = [f"{self.model} v{self.version}: {self.rows} held-out rows", head]
        for v in self.variants:
            failures = v.failures(self.tolerance)
            verdict = "pass" if not failures else "REFUSED: " + "; ".join(failures)
            lines.append(
                f"{v.precision:<10}{v.max_abs_error:>12.5f}{v.mean_abs_error:>13.6f}"
                f"{v.auc:>8.4f}{v.auc_drop:>10.5f}{v.flip_rate:>10.4f}  {verdict}"
            )
        return "\n".join(lines)


def _scores(
    engine: OnnxRuntimeEngine, inputs: Mapping[str, np.ndarray], score: ScoreOutput
) -> np.ndarray:
    rows = len(next(iter(inputs.values())))
    chunks = []
    for start in range(0, rows, 1024):
        batch = {n: a[start : start + 1024] for n, a in inputs.items()}
        chunks.append(score.scores(engine.infer(batch)).astype(np.float64))
    return np.concatenate(chunks)


def _variant_files(model_dir: Path, manifest: Manifest) -> list[tuple[str, str]]:
    files = [("fp32", FP32_FILE)]
    order = [p for p in PRECISION_ORDER if p in manifest.variants]
    order += sorted(p for p in manifest.variants if p not in PRECISION_ORDER)
    files += [(p, manifest.variants[p]) for p in order if p != "fp32"]
    return files


def validate_model(
    model_dir: Path,
    inputs: Mapping[str, np.ndarray],
    labels: np.ndarray,
    manifest: Manifest | None = None,
) -> ValidationReport:
    """Score `inputs` with FP32 and each variant in the manifest; compare each with FP32."""
    manifest = manifest or load_manifest(model_dir)
    labels = np.asarray(labels).ravel()
    decide = np.vectorize(manifest.thresholds.decide, otypes=[object])
    reference: np.ndarray | None = None
    ref_auc = 0.0
    ref_decisions: np.ndarray | None = None
    reports = []
    score = resolve_score_output(model_dir / FP32_FILE, manifest)
    for precision, file in _variant_files(model_dir, manifest):
        # Hashed before it is read: a file replaced meanwhile then fails the check at load.
        sha256 = sha256_file(model_dir / file)
        engine = OnnxRuntimeEngine.from_model_dir(
            model_dir, manifest, precision=precision, score=score
        )
        try:
            scores = _scores(engine, inputs, score)
        finally:
            engine.close()
        with np.errstate(invalid="ignore"):  # a NaN score: counted and refused below
            decisions = decide(scores)
        if reference is None or ref_decisions is None:
            reference, ref_decisions, ref_auc = scores, decisions, auc(labels, scores)
        error = np.abs(scores - reference)
        this_auc = auc(labels, scores)
        reports.append(
            VariantReport(
                precision=precision,
                file=file,
                sha256=sha256,
                max_abs_error=float(error.max()),
                mean_abs_error=float(error.mean()),
                auc=this_auc,
                # np.maximum keeps a NaN, where max(0.0, nan) would give 0.0.
                auc_drop=float(np.maximum(0.0, ref_auc - this_auc)),
                flip_rate=float(np.mean(decisions != ref_decisions)),
                non_finite_scores=int(np.count_nonzero(~np.isfinite(scores))),
            )
        )
    return ValidationReport(
        model=manifest.name,
        version=manifest.version,
        rows=int(labels.size),
        tolerance=manifest.tolerance,
        variants=tuple(reports),
    )


def write_report(model_dir: Path, report: ValidationReport) -> Path:
    path = model_dir / REPORT_FILE
    path.write_text(report.to_json() + "\n")
    return path


def load_report(model_dir: Path) -> ValidationReport | None:
    path = model_dir / REPORT_FILE
    return ValidationReport.from_json(path.read_text()) if path.exists() else None


def accepted_variants(
    model_dir: Path, report: ValidationReport | None = None, manifest: Manifest | None = None
) -> dict[str, Path]:
    """Precision -> ONNX path of every variant allowed to load: FP32 always, others only if
    `report` (else the saved ``validation.json``) shows they pass the manifest's tolerance and
    both ``model.onnx`` and the variant's file still have the sha256 the report recorded.

    Variants refused for want of a report that vouches for them as they are now (none, one for
    another version, one without hashes, files changed since) are named in one WARNING that
    says why and to run ``riskserve validate``; one that failed the tolerance is refused as the
    report says.
    """
    manifest = manifest or load_manifest(model_dir)
    accepted = {"fp32": model_dir / FP32_FILE}
    if not manifest.variants:
        return accepted
    problem = None
    if report is None:
        try:
            report = load_report(model_dir)
        except (ValueError, KeyError, TypeError) as exc:
            problem = f"the report does not parse ({exc!r})"
    problem = problem or _report_problem(model_dir, manifest, report)
    refused: list[str] = []
    if problem is not None:
        refused.append(", ".join(f"{p} ({f})" for p, f in manifest.variants.items()))
        refused[-1] += f": {problem}"
    else:
        assert report is not None
        checked = {v.precision: v for v in report.variants}
        for precision, file in manifest.variants.items():
            why = _variant_problem(model_dir, file, checked.get(precision))
            if why is not None:
                refused.append(f"{precision} ({file}): {why}")
            elif checked[precision].passes(manifest.tolerance):
                accepted[precision] = model_dir / file
    if refused:
        log.warning(
            "%s: not loading variants %s; run `riskserve validate %s` to check them again",
            model_dir / REPORT_FILE,
            "; ".join(refused),
            model_dir,
        )
    return accepted


def _report_problem(
    model_dir: Path, manifest: Manifest, report: ValidationReport | None
) -> str | None:
    """Why `report` vouches for no variant of the version in `model_dir`; None if it may."""
    if report is None:
        return "no report has been written"
    if (report.model, report.version) != (manifest.name, manifest.version):
        return (
            f"the report is for {report.model} version {report.version}, "
            f"not {manifest.name} version {manifest.version}"
        )
    recorded = report.onnx_sha256
    if recorded is None:
        return "the report records no file hashes (an older format)"
    current = sha256_file(model_dir / FP32_FILE)
    if recorded != current:
        return (
            f"{FP32_FILE} has changed since the report was made (sha256 {current[:12]}, "
            f"the report has {recorded[:12]})"
        )
    return None


def _variant_problem(model_dir: Path, file: str, entry: VariantReport | None) -> str | None:
    """Why the report's `entry` does not vouch for the variant `file`; None if it does."""
    if entry is None or entry.file != file:
        return "not in the report"
    if entry.sha256 is None:
        return "the report records no hash of it"
    path = model_dir / file
    if not path.is_file():
        return "the file is missing"
    if entry.sha256 != sha256_file(path):
        return "changed since the report was made"
    return None
