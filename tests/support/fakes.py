"""The one test seam for batching and fallback logic: an engine with set latency and faults."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from engines.base import DimRange, Engine, EngineFailure, Profile, TensorSpec
from engines.manifest import Manifest
from engines.output import ScoreOutput


def expected_score(features: np.ndarray) -> np.ndarray:
    """What FakeEngine returns for each row: a function of that row alone."""
    return 1.0 / (1.0 + np.exp(-features.sum(axis=1) / 10.0))


class FakeEngine(Engine):
    """Scores rows as `expected_score`, taking `base_s + per_row_s * rows`, failing on demand.

    `max_rows` and `max_history` declare a profile the way a TensorRT engine does, so a batch
    outside it raises ShapeMismatch before anything runs. The faults are plain attributes a
    test may flip while the engine serves: `fail` raises EngineFailure, `nan` returns NaN
    scores, and `hang` (an Event) blocks each call until the event is set.
    """

    kind = "fake"

    def __init__(
        self,
        manifest: Manifest,
        *,
        name: str = "fake",
        base_s: float = 0.0,
        per_row_s: float = 0.0,
        max_rows: int | None = None,
        max_history: int | None = None,
        fail: bool = False,
        concurrency: int = 1,
        nan: bool = False,
        hang: threading.Event | None = None,
    ) -> None:
        self.name = name
        self.precision = "fp32"
        self.max_concurrency = concurrency
        self.base_s = base_s
        self.per_row_s = per_row_s
        self.fail = fail
        self.nan = nan
        self.hang = hang
        self.batches: list[int] = []
        self._lock = threading.Lock()
        batch = DimRange(1, 1, max_rows)
        specs = [
            TensorSpec(
                manifest.features_input,
                "float32",
                (batch, DimRange(manifest.n_features, manifest.n_features, manifest.n_features)),
            )
        ]
        if manifest.history is not None:
            length = DimRange(1, 1, max_history)
            width = len(manifest.history.fields)
            specs += [
                TensorSpec(
                    manifest.history.input,
                    "float32",
                    (batch, length, DimRange(width, width, width)),
                ),
                TensorSpec(manifest.history.mask_input, "float32", (batch, length)),
            ]
        self.profiles = (Profile(0, tuple(specs)),)
        self._features = manifest.features_input
        self._output = manifest.output

    def _infer(self, inputs: Mapping[str, np.ndarray], profile: Profile) -> dict[str, np.ndarray]:
        features = inputs[self._features]
        rows = features.shape[0]
        with self._lock:
            self.batches.append(rows)
        time.sleep(self.base_s + self.per_row_s * rows)
        if self.hang is not None:
            self.hang.wait()
        if self.fail:
            raise EngineFailure(f"{self.name}: injected failure")
        scores = expected_score(features).astype(np.float32).reshape(-1, 1)
        if self.nan:
            scores[:] = np.nan
        return {self._output: scores}


def fake_factory(**options) -> tuple:
    """An engine factory serving every model with one FakeEngine; returns (factory, engines)."""
    made: dict[str, FakeEngine] = {}

    def build(path: Path, manifest: Manifest, score: ScoreOutput):
        engine = FakeEngine(manifest, **options)
        made[manifest.name] = engine
        return [], engine

    return build, made


def primary_and_fallback(**primary_options) -> tuple:
    """A factory serving every model with a FakeEngine "primary" before a FakeEngine fallback.

    Returns (factory, made): made[model name] is the (primary, fallback) pair.
    """
    made: dict[str, tuple[FakeEngine, FakeEngine]] = {}

    def build(path: Path, manifest: Manifest, score: ScoreOutput):
        primary = FakeEngine(manifest, name="primary", **primary_options)
        fallback = FakeEngine(manifest, name="fallback")
        made[manifest.name] = (primary, fallback)
        return [primary], fallback

    return build, made
