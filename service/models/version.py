"""`ModelVersion`: one servable model version, what the handlers need to score rows."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
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
