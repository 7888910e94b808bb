"""`ChallengerScorer`: score shadow jobs in the worker process and log one record per row.

Jobs that arrived together are merged per (model, champion version, challenger version) into
one engine call (histories padded with masked zeros, as the batcher does), so a worker that
fell behind catches up with large batches instead of one call per job. Each challenger runs on
its own ONNX Runtime FP32 session on the CPU with one intra-op thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engines.base import Engine
from engines.manifest import Manifest, load_manifest
from engines.onnxrt import OnnxRuntimeEngine
from engines.output import ScoreOutput, resolve_score_output
from service.batching.rows import RowBatch
from service.explanations.reasons import ADVERSE_DECISIONS, Occlusion, log_codes
from service.shadow.job import ShadowJob
from service.shadow.log import ExperimentLog
from service.shadow.record import ExperimentRecord

__all__ = ["ChallengerScorer", "ScoringOutcome"]

_log = logging.getLogger(__name__)

Key = tuple[str, str]  # (model, version)


@dataclass
class ScoringOutcome:
    """Jobs finished per model: completed (every version scored and logged) or failed."""

    completed: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    decision_flips: int = 0


class ChallengerScorer:
    """Loads each model version it is told about on first use and scores merged jobs."""

    def __init__(self, log: ExperimentLog, *, max_rows_per_call: int = 256) -> None:
        self._log = log
        self._max_rows = max_rows_per_call
        self._dirs: dict[Key, Path] = {}
        self._manifests: dict[Key, Manifest] = {}
        self._engines: dict[Key, tuple[Engine, ScoreOutput]] = {}
        self._occlusions: dict[Key, Occlusion] = {}

    def add_version(self, model: str, version: str, model_dir: Path) -> None:
        """Where a version's files are; a version announced again has new files: reload them."""
        key = (model, version)
        self._dirs[key] = model_dir
        self._manifests.pop(key, None)
        self._occlusions.pop(key, None)
        loaded = self._engines.pop(key, None)
        if loaded is not None:
            loaded[0].close()

    def score(self, jobs: Sequence[ShadowJob]) -> ScoringOutcome:
        groups: dict[tuple[str, str, str], list[int]] = {}
        for i, job in enumerate(jobs):
            for version in job.versions:
                groups.setdefault((job.model, job.champion_version, version), []).append(i)
        outcome = ScoringOutcome()
        failed: set[int] = set()
        for (model, champion, version), indices in groups.items():
            try:
                self._score_group(model, champion, version, [jobs[i] for i in indices], outcome)
            except Exception:  # a challenger failure is counted, never raised to the server
                if len(indices) == 1:
                    _log.exception("shadow scoring of %s version %s failed", model, version)
                    failed.update(indices)
                    continue
                for i in indices:  # one bad job must not fail the others merged with it
                    try:
                        self._score_group(model, champion, version, [jobs[i]], outcome)
                    except Exception:
                        _log.exception("shadow scoring of %s version %s failed", model, version)
                        failed.add(i)
        for i, job in enumerate(jobs):
            (outcome.failed if i in failed else outcome.completed)[job.model] += 1
        return outcome

    def close(self) -> None:
        for engine, _ in self._engines.values():
            engine.close()
        self._engines.clear()

    def _manifest(self, key: Key) -> Manifest:
        if key not in self._manifests:
            if key not in self._dirs:
                raise LookupError(f"{key[0]} version {key[1]} was never announced")
            self._manifests[key] = load_manifest(self._dirs[key])
        return self._manifests[key]

    def _engine(self, key: Key) -> tuple[Engine, ScoreOutput]:
        """The version's engine and where its score is among the engine's outputs."""
        if key not in self._engines:
            model_dir, manifest = self._dirs[key], self._manifest(key)
            score = resolve_score_output(model_dir / "model.onnx", manifest)
            engine = OnnxRuntimeEngine.from_model_dir(
                model_dir,
                manifest,
                providers=("CPUExecutionProvider",),
                intra_op_threads=1,
                max_concurrency=1,
                score=score,
            )
            self._engines[key] = (engine, score)
            _log.info("shadow worker loaded %s version %s", *key)
        return self._engines[key]

    def _score_group(
        self,
        model: str,
        champion_version: str,
        version: str,
        jobs: list[ShadowJob],
        outcome: ScoringOutcome,
    ) -> None:
        champion = self._manifest((model, champion_version))
        challenger = self._manifest((model, version))
        engine, score = self._engine((model, version))
        feeds = [challenger_feed(challenger, champion, job.inputs) for job in jobs]
        starts = np.cumsum([0] + [len(job.request_ids) for job in jobs])
        rows = int(starts[-1])
        occlusion = self._occlusion((model, version))
        explaining = _explaining(jobs) if occlusion.codes else []
        # "always" rows: their occluded rows join the plain rows in the same engine call.
        always = [(j, i) for j, i in explaining if jobs[j].explain_when == "always"]
        blocks = [_occluded(occlusion, challenger, feeds[j], i) for j, i in always]
        scores, latency_s = self._infer(
            engine, score, challenger, merge(challenger, feeds + blocks)
        )
        codes = _codes(occlusion, jobs, always, starts, scores[:rows], scores[rows:])
        # "adverse" rows: explained, as the champion does, only on a REVIEW or DECLINE of their own.
        adverse = [
            (j, i)
            for j, i in explaining
            if jobs[j].explain_when == "adverse"
            and challenger.thresholds.decide(float(scores[starts[j] + i])) in ADVERSE_DECISIONS
        ]
        if adverse:
            occluded = [_occluded(occlusion, challenger, feeds[j], i) for j, i in adverse]
            adverse_scores, _ = self._infer(engine, score, challenger, merge(challenger, occluded))
            codes.update(_codes(occlusion, jobs, adverse, starts, scores[:rows], adverse_scores))
        for j, job in enumerate(jobs):
            for i in range(len(job.request_ids)):
                row = int(starts[j]) + i
                outcome.decision_flips += self._log_row(
                    job, i, version, float(scores[row]), engine.name, float(latency_s[row]),
                    challenger, champion, codes.get((j, i), ()),
                )  # fmt: skip

    def _infer(
        self,
        engine: Engine,
        score: ScoreOutput,
        manifest: Manifest,
        feed: Mapping[str, np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Scores of every row of `feed`, and the engine time of the call each row was in."""
        rows = len(feed[manifest.features_input])
        scores = np.empty(rows, dtype=np.float64)
        latency_s = np.empty(rows, dtype=np.float64)
        for start in range(0, rows, self._max_rows):
            end = min(start + self._max_rows, rows)
            chunk = {name: array[start:end] for name, array in feed.items()}
            started = time.perf_counter()
            outputs = engine.infer(chunk)
            latency_s[start:end] = time.perf_counter() - started
            scores[start:end] = score.scores(outputs)
        return scores, latency_s

    def _occlusion(self, key: Key) -> Occlusion:
        if key not in self._occlusions:
            self._occlusions[key] = Occlusion(self._manifest(key))
        return self._occlusions[key]

    def _log_row(
        self,
        job: ShadowJob,
        i: int,
        version: str,
        score: float,
        engine: str,
        latency_s: float,
        challenger: Manifest,
        champion: Manifest,
        reason_codes: tuple[str, ...] = (),
    ) -> int:
        decision = challenger.thresholds.decide(score)
        self._log.log(
            ExperimentRecord(
                request_id=job.request_ids[i],
                entity_id=job.entity_ids[i],
                experiment=job.experiment,
                model=job.model,
                arm="challenger",
                version=version,
                score=score,
                decision=decision,
                engine=engine,
                latency_ms=latency_s * 1e3,
                mode=job.mode,
                served=False,
                reason_codes=reason_codes,
            )
        )
        return int(decision != champion.thresholds.decide(float(job.champion_scores[i])))


def _explaining(jobs: Sequence[ShadowJob]) -> list[tuple[int, int]]:
    """(job, row) of every row whose served request asked for reasons."""
    return [
        (j, i)
        for j, job in enumerate(jobs)
        if job.explain_top_k > 0
        for i in range(len(job.request_ids))
    ]


def _occluded(
    occlusion: Occlusion, manifest: Manifest, feed: Mapping[str, np.ndarray], i: int
) -> dict[str, np.ndarray]:
    """The occluded rows of row `i` of a challenger feed, as a feed of their own."""
    spec = manifest.history
    features = feed[manifest.features_input][i : i + 1]
    history = feed[spec.input][i : i + 1] if spec is not None else None
    mask = feed[spec.mask_input][i : i + 1] if spec is not None else None
    features, history, mask = occlusion.occluded(features, history, mask)
    out = {manifest.features_input: features}
    if spec is not None and history is not None and mask is not None:
        out[spec.input], out[spec.mask_input] = history, mask
    return out


def _codes(
    occlusion: Occlusion,
    jobs: Sequence[ShadowJob],
    explained: Sequence[tuple[int, int]],
    starts: np.ndarray,
    plain: np.ndarray,
    occluded: np.ndarray,
) -> dict[tuple[int, int], tuple[str, ...]]:
    """Each explained row's logged codes: its own score, then its occluded rows' in order."""
    n = len(occlusion.codes)
    codes = {}
    for k, (j, i) in enumerate(explained):
        row = int(starts[j]) + i
        block = np.concatenate([plain[row : row + 1], occluded[k * n : (k + 1) * n]])
        codes[(j, i)] = tuple(log_codes(occlusion.reasons(block, jobs[j].explain_top_k)))
    return codes


def challenger_feed(
    challenger: Manifest, champion: Manifest, inputs: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The champion's validated inputs renamed (and features reordered) for the challenger."""
    features = inputs[champion.features_input]
    if challenger.features != champion.features:
        missing = set(challenger.features) - set(champion.features)
        if missing:
            raise ValueError(f"the champion's requests lack features {sorted(missing)}")
        features = features[:, [champion.features.index(n) for n in challenger.features]]
    feed = {challenger.features_input: features}
    spec = challenger.history
    if spec is not None:
        if champion.history is None or champion.history.fields != spec.fields:
            raise ValueError("the challenger's history fields differ from the champion's")
        feed[spec.input] = inputs[champion.history.input]
        feed[spec.mask_input] = inputs[champion.history.mask_input]
    return feed


def merge(manifest: Manifest, feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The feeds' rows as one engine feed of `manifest`'s inputs, joined (and their histories
    padded) by the server's one row join, `RowBatch.concat`."""
    spec = manifest.history
    parts = [
        RowBatch(
            feed[manifest.features_input],
            None if spec is None else feed[spec.input],
            None if spec is None else feed[spec.mask_input],
        )
        for feed in feeds
    ]
    return RowBatch.concat(parts).feed(manifest)
