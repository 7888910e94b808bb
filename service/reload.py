"""Hot reload: serve a model version that appears under models_dir, without a restart.

`ModelWatcher.scan` looks for version folders higher than what each model serves (or models
not served at all). Each is loaded and warmed beside the serving version, then activated in one
step on the event loop (requests that already hold the old version finish on it), then the old
version's queue is drained and it is unloaded. A scan runs every `interval_s` (0: never on a
timer) and whenever `trigger()` is called, which the server does on SIGHUP.

A folder being copied in is not loaded half-written: a timed scan loads a folder only once its
files (names, sizes, mtimes) are the same as at the previous scan. A triggered scan trusts the
operator and loads at once. A folder that fails to load is not retried until its files change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from service.registry import ModelRegistry, discover_models, version_key

__all__ = ["ModelWatcher"]

log = logging.getLogger(__name__)

_Snapshot = tuple[tuple[str, int, int], ...]


def _snapshot(folder: Path) -> _Snapshot:
    entries = []
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            stat = path.stat()
            entries.append((str(path.relative_to(folder)), stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


class ModelWatcher:
    """Loads, activates and retires model versions as folders appear under `models_dir`."""

    def __init__(
        self, registry: ModelRegistry, models_dir: Path, *, interval_s: float, drain_s: float
    ) -> None:
        self._registry = registry
        self._models_dir = models_dir
        self.interval_s = interval_s
        self.drain_s = drain_s
        self._seen: dict[Path, _Snapshot] = {}
        self._failed: dict[Path, _Snapshot] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._forced = False
        self._task: asyncio.Task[None] | None = None
        self.swaps = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="model-watcher")

    def trigger(self) -> None:
        """Scan now and load what is new without waiting for its files to settle (SIGHUP)."""
        self._forced = True
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            timeout = self.interval_s if self.interval_s > 0 else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            forced, self._forced = self._forced, False
            try:
                await self.scan(settle=not forced)
            except Exception:
                log.exception("model scan failed")

    async def scan(self, *, settle: bool = False) -> list[str]:
        """Load and switch to new versions; returns them as ``name/version``."""
        async with self._lock:
            swapped = []
            for path in self._candidates():
                snapshot = _snapshot(path)
                previous, self._seen[path] = self._seen.get(path), snapshot
                if (settle and snapshot != previous) or self._failed.get(path) == snapshot:
                    continue
                if await self._swap(path, snapshot):
                    swapped.append(f"{path.parent.name}/{path.name}")
            return swapped

    def _candidates(self) -> list[Path]:
        registry = self._registry
        found = []
        for name, versions in discover_models(self._models_dir).items():
            serving = registry.get(name).version if name in registry.names() else None
            newest = versions[-1]
            newer = serving is None or version_key(newest.name) > version_key(serving)
            if newer and newest.name not in registry.versions(name):
                found.append(newest)
        return found

    async def _swap(self, path: Path, snapshot: _Snapshot) -> bool:
        registry = self._registry
        name = path.parent.name
        old = registry.get(name).version if name in registry.names() else None
        try:
            model = await registry.load(path, activate=False)
        except Exception:
            log.exception("could not load %s; it is retried once its files change", path)
            self._failed[path] = snapshot
            return False
        registry.activate(model.name, model.version)
        self.swaps += 1
        log.info("hot reload: %s now serves version %s (was %s)", name, model.version, old)
        if old is not None:
            await registry.unload(name, old, self.drain_s)
            log.info("hot reload: %s version %s drained and unloaded", name, old)
        return True
