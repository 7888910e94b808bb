"""Request payloads for the load test: realistic feature values and transaction histories.

Values come from the demo's generative process when `demo.generator` is importable and its
feature names match the served model; otherwise from simple per-name distributions, so the load
test runs against any model whose schema the server reports.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

__all__ = ["TrafficSource"]

_POOL_SIZE = 2048
_ENTITY_COUNT = 5000

logger = logging.getLogger(__name__)


class TrafficSource:
    """Draws feature dicts, history windows and entity ids from a pool built once."""

    def __init__(
        self,
        feature_names: Sequence[str],
        history_fields: Sequence[str],
        features: np.ndarray,
        history_rows: np.ndarray,
        entity_ids: Sequence[str],
        seed: int,
    ) -> None:
        self.feature_names = tuple(feature_names)
        self.history_fields = tuple(history_fields)
        self._features = features.astype(np.float32, copy=False)
        self._rows = history_rows.astype(np.float32, copy=False)
        self._entity_ids = tuple(entity_ids)
        self._rng = np.random.default_rng(seed)
        self.origin = "random"

    @classmethod
    def for_schema(
        cls, feature_names: Sequence[str], history_fields: Sequence[str], seed: int = 0
    ) -> TrafficSource:
        """From the demo generator when it describes this model, else from random values."""
        source = _from_demo(feature_names, history_fields, seed)
        if source is not None:
            return source
        rng = np.random.default_rng(seed)
        features = np.stack([_draw(name, rng, _POOL_SIZE) for name in feature_names], axis=1)
        n_rows = _POOL_SIZE * 8
        if history_fields:
            rows = np.stack([_draw(name, rng, n_rows) for name in history_fields], axis=1)
        else:
            rows = np.zeros((n_rows, 0), dtype=np.float32)
        entities = [f"acct-{i:06d}" for i in range(_ENTITY_COUNT)]
        return cls(feature_names, history_fields, features, rows, entities, seed + 1)

    def entity_id(self) -> str:
        return self._entity_ids[int(self._rng.integers(len(self._entity_ids)))]

    def feature_vector(self) -> np.ndarray:
        return self._features[int(self._rng.integers(len(self._features)))]

    def features(self) -> dict[str, float]:
        vector = self.feature_vector()
        return {name: float(v) for name, v in zip(self.feature_names, vector, strict=True)}

    def history(self, n_rows: int) -> np.ndarray:
        """A window of `n_rows` consecutive rows from the pool, shape (n_rows, fields)."""
        total = len(self._rows)
        if n_rows >= total:
            reps = n_rows // total + 1
            return np.tile(self._rows, (reps, 1))[:n_rows]
        start = int(self._rng.integers(total - n_rows + 1))
        return self._rows[start : start + n_rows]

    def integers(self, low: int, high_inclusive: int) -> int:
        return int(self._rng.integers(low, high_inclusive + 1))

    def random(self) -> float:
        return float(self._rng.random())


def _from_demo(
    feature_names: Sequence[str], history_fields: Sequence[str], seed: int
) -> TrafficSource | None:
    try:
        from demo import generator
    except ImportError:
        return None
    if tuple(generator.FEATURE_NAMES) != tuple(feature_names):
        return None
    if tuple(generator.HISTORY_FIELDS) != tuple(history_fields):
        return None
    try:
        data = generator.generate(_POOL_SIZE, seed)
    except Exception:
        logger.exception("demo generator failed; using random feature values")
        return None
    histories = [np.asarray(h, dtype=np.float32) for h in data.histories if len(h)]
    width = len(history_fields)
    rows = np.concatenate(histories) if histories else np.zeros((1, width), np.float32)
    source = TrafficSource(
        feature_names,
        history_fields,
        np.asarray(data.features, dtype=np.float32),
        rows,
        [str(e) for e in data.entity_ids],
        seed + 1,
    )
    source.origin = "demo.generator"
    return source


def _draw(name: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """Plausible values for a feature judged by its name; unknown names get N(0, 1)."""
    lowered = name.lower()
    if any(k in lowered for k in ("amount", "balance", "value", "price", "income")):
        values = rng.lognormal(mean=3.5, sigma=1.2, size=n)
    elif lowered.startswith(("is_", "has_")) or "flag" in lowered:
        values = rng.random(n) < 0.1
    elif "hour" in lowered:
        values = rng.integers(0, 24, size=n)
    elif any(k in lowered for k in ("count", "num_", "n_")):
        values = rng.poisson(3.0, size=n)
    elif any(k in lowered for k in ("age", "days", "tenure")):
        values = rng.gamma(2.0, 200.0, size=n)
    elif any(k in lowered for k in ("ratio", "rate", "share", "score")):
        values = rng.beta(2.0, 5.0, size=n)
    else:
        values = rng.normal(0.0, 1.0, size=n)
    return np.asarray(values, dtype=np.float32)
