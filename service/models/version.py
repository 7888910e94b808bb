"""`ModelVersion`: one servable model version, what the handlers need to score rows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from engines.base import Engine
from engines.manifest import Manifest
from engines.output import ScoreOutput
from engines.pool import EnginePool
from service.batching.batcher import MicroBatcher
from service.models.folders import FolderSnapshot

__all__ = ["ModelVersion"]


@dataclass
class ModelVersion:
    """One servable model version: what the handlers need to score rows."""

    manifest: Manifest
    path: Path
    pool: EnginePool
    batcher: MicroBatcher
    score: ScoreOutput
    """Where the score is among the engines' outputs (the layout resolved at load)."""
    files: FolderSnapshot = ()
    """The folder's files as they were when this version started loading."""
    holders: int = field(default=0, compare=False)
    """Score requests being scored by this version, from their first submit to their last (an
    explained one submits its row, then the rows that explain it)."""

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold this version while a request may still submit to it: a reload retiring it
        lets the request finish (`until_released`) before the batcher stops admitting."""
        self.holders += 1
        try:
            yield
        finally:
            self.holders -= 1

    async def until_released(self, timeout_s: float) -> None:
        """Wait, up to `timeout_s`, until no request holds this version (event loop)."""
        deadline = time.monotonic() + timeout_s
        while self.holders and time.monotonic() < deadline:
            await asyncio.sleep(0.001)

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version

    def engines(self) -> Iterator[Engine]:
        """Every engine of the pool in the order tried, the fallback last, each once."""
        seen = set()
        for engine in (*self.pool.engines, self.pool.fallback):
            if id(engine) not in seen:
                seen.add(id(engine))
                yield engine
