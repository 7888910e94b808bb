"""`ChallengerScorer`: score shadow jobs in the worker process and log one record per row.

Jobs that arrived together are merged per (model, champion version, challenger version) and
their rows regrouped as the server's batcher groups requests: by history length, each engine
call at most `max_rows_per_call` rows with bounded padding (`length_groups`). So a worker that
fell behind catches up with large batches instead of one call per job, and a long history never
makes every short one in its pass pay for its length. Each challenger runs on its own ONNX
Runtime FP32 session on the CPU with one intra-op thread.

Each call is also short (at most `max_cells_per_call` padded history cells, a millisecond or
so of the demo model) and the worker sleeps `pause_s` before each one. Idle priority alone does
not keep the worker out of the champion's way on a small machine: a CPU that runs it never goes
idle, so the kernel does not pull a server or client thread waiting on the other CPU's queue
over to it until its next periodic balance, milliseconds later. Pausing between short calls
lets the CPU go idle often; measured on two vCPUs (`python -m bench.shadow_load`), it takes
the champion's p99 with shadowing from 1.3x to within noise of none.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engines.base import Engine
from engines.manifest import Manifest, load_manifest
from engines.onnxrt import OnnxRuntimeEngine
from engines.output import ScoreOutput, resolve_score_output
from service.batching.rows import RowBatch, length_groups
from service.explanations.reasons import ADVERSE_DECISIONS, Occlusion, log_codes
from service.shadow.job import ShadowJob
from service.shadow.log import ExperimentLog
from service.shadow.record import ExperimentRecord

__all__ = ["ChallengerScorer", "ScoringOutcome"]

_log = logging.getLogger(__name__)

# The most padded history cells (rows x history length) in one engine call, unless it is one
# row; and the sleep before each call (see the module's notes).
MAX_CELLS_PER_CALL = 256
# The most versions whose sessions the worker keeps loaded: the least recently scored one is
# closed past it (loaded again from its folder if it is shadowed again), so a deployment that
# rotates challengers does not keep every session it ever loaded.
MAX_LOADED_VERSIONS = 8
PAUSE_S = 0.001

Key = tuple[str, str]  # (model, version)


@dataclass
class ScoringOutcome:
    """Jobs finished per model: completed (every version scored and logged) or failed."""

    completed: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    decision_flips: int = 0


class ChallengerScorer:
    """Loads each model version it is told about on first use and scores merged jobs."""

    def __init__(
        self,
        log: ExperimentLog,
        *,
        max_rows_per_call: int = 64,
        max_cells_per_call: int | None = MAX_CELLS_PER_CALL,
        pause_s: float = PAUSE_S,
    ) -> None:
        self._log = log
        self._max_rows = max_rows_per_call
        self._max_cells = max_cells_per_call
        self._pause_s = pause_s
        self._dirs: dict[Key, Path] = {}
        self._manifests: dict[Key, Manifest] = {}
        self._engines: OrderedDict[Key, tuple[Engine, ScoreOutput]] = OrderedDict()
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
        if key in self._engines:
            self._engines.move_to_end(key)
        else:
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
            while len(self._engines) > MAX_LOADED_VERSIONS:
                least, (unused, _) = self._engines.popitem(last=False)
                unused.close()
                self._manifests.pop(least, None)
                self._occlusions.pop(least, None)
                _log.info("shadow worker closed %s version %s (least recently scored)", *least)
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
        scores, latency_s = self._infer(engine, score, challenger, feeds + blocks)
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
            adverse_scores, _ = self._infer(engine, score, challenger, occluded)
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
        feeds: Sequence[Mapping[str, np.ndarray]],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Scores of every row of `feeds` in order, and the engine time of each row's call."""
        parts = [row_batch(manifest, feed) for feed in feeds]
        batch = RowBatch.concat(parts, manifest.history)
        lengths = np.concatenate([part.history_lengths() for part in parts])
        floor = manifest.history.min_padded_length if manifest.history is not None else 1
        scores = np.empty(batch.rows, dtype=np.float64)
        latency_s = np.empty(batch.rows, dtype=np.float64)
        for index in length_groups(lengths, self._max_rows, max_cells=self._max_cells):
            if self._pause_s:
                time.sleep(self._pause_s)
            chunk = batch.take(index, max(floor, int(lengths[index[-1]]), 1))
            started = time.perf_counter()
            outputs = engine.infer(chunk.feed(manifest))
            latency_s[index] = time.perf_counter() - started
            scores[index] = score.scores(outputs)
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


def row_batch(manifest: Manifest, feed: Mapping[str, np.ndarray]) -> RowBatch:
    """A challenger feed as the server's `RowBatch`."""
    spec = manifest.history
    return RowBatch(
        feed[manifest.features_input],
        None if spec is None else feed[spec.input],
        None if spec is None else feed[spec.mask_input],
    )
