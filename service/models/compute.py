"""Running one merged batch of rows on a model version's engine pool."""

from __future__ import annotations

import time

from engines.base import EngineError
from engines.manifest import Manifest
from engines.output import ScoreOutput
from engines.pool import EnginePool
from service.batching.batcher import Scored
from service.batching.rows import RowBatch
from service.errors import ScoringFailed

__all__ = ["run_on_pool"]


def run_on_pool(
    manifest: Manifest,
    score: ScoreOutput,
    pool: EnginePool,
    precisions: dict[str, str],
    rows: RowBatch,
) -> Scored:
    """Score merged rows on the engine pool (runs on an engine thread)."""
    started = time.perf_counter()
    try:
        result = pool.run(rows.feed(manifest))
    except EngineError as exc:
        raise ScoringFailed("no engine could score the batch") from exc
    engine_s = time.perf_counter() - started
    scores = score.scores(result.outputs)
    precision = precisions.get(result.engine_name, "")
    split = len(set(result.row_engines)) > 1
    return Scored(
        scores,
        result.engine_name,
        result.fallback_reason,
        engine_s,
        precision,
        result.row_engines if split else (),
        batch_rows=rows.rows,
    )
