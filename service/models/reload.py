"""Hot reload: serve what changes under models_dir without a restart.

`ModelWatcher.scan` looks for two kinds of change:

- a version folder newer than every loaded version of its model (or of a model not loaded at
  all), or one that an experiment or a pin names and that is not loaded: it is loaded and
  warmed beside what serves. Whether it then serves is the registry's serving rule:
  it does when nothing names another version (no experiment champion, no pinned version), and
  the version it replaced is then drained and unloaded. Where an experiment or a pin names the
  serving version, a new version changes nothing for callers that name no version.
- a loaded version whose folder's files changed in place (a new ``model.onnx`` or manifest under
  the same version): the new files are loaded and warmed beside the old instance, which is
  swapped out in one step on the event loop and drained (`ModelRegistry.reload`). If the new
  files do not load, the old instance serves on, the error is logged and counted
  (``riskserve_model_reloads_total{outcome="refused"}``); nothing is silently ignored.

A refused change is logged once, as one ERROR line that names the folder and the reason; its
traceback goes to DEBUG.

A scan runs every `interval_s` (0: never on a timer) and whenever `trigger()` is called, which
the server does on SIGHUP. A folder being copied in is not loaded half-written: a timed scan acts
on a folder only once its files (names, sizes, mtimes) have stood still for a quarter second. A
triggered scan trusts the operator and acts at once. Files that failed to load are not retried
until they change again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from service.models.folders import FolderSnapshot, discover_models, folder_snapshot, version_key
from service.models.registry import ModelRegistry
from service.telemetry import Telemetry

__all__ = ["ModelWatcher"]

log = logging.getLogger(__name__)

# How long a changed folder's files must stand still before a timed scan acts on them.
_QUIET_S = 0.25


class ModelWatcher:
    """Loads new model versions, reloads changed ones, and retires versions that stop serving."""

    def __init__(
        self,
        registry: ModelRegistry,
        models_dir: Path,
        *,
        interval_s: float,
        drain_s: float,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._registry = registry
        self._models_dir = models_dir
        self.interval_s = interval_s
        self.drain_s = drain_s
        self._metrics = telemetry.metrics if telemetry is not None else None
        self._seen: dict[Path, FolderSnapshot] = {}
        self._failed: dict[Path, FolderSnapshot] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._forced = False
        self._task: asyncio.Task[None] | None = None
        self.swaps = 0
        self.reloads = 0
        self.refused = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="model-watcher")

    def trigger(self) -> None:
        """Scan now and act on what changed without waiting for its files to settle (SIGHUP)."""
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
        """Load new versions and reload changed ones; returns them as ``name/version``."""
        async with self._lock:
            done = []
            for path, changed in [(p, False) for p in self._new()] + [
                (p, True) for p in self._changed()
            ]:
                snapshot = await self._settled(path) if settle else folder_snapshot(path)
                if snapshot is None or self._failed.get(path) == snapshot:
                    continue
                if await (self._reload(path, snapshot) if changed else self._add(path, snapshot)):
                    done.append(f"{path.parent.name}/{path.name}")
            return done

    async def _settled(self, path: Path) -> FolderSnapshot | None:
        """The folder's files once they have stood still for a moment; None while they move.

        Files seen unchanged since the previous scan are settled. Files that changed since are
        looked at again after `_QUIET_S`, so a change is acted on by the first scan after it,
        not the second; a copy still writing is seen moving and left for the next scan.
        """
        snapshot = folder_snapshot(path)
        if snapshot != self._seen.get(path):
            self._seen[path] = snapshot
            await asyncio.sleep(_QUIET_S)
            if folder_snapshot(path) != snapshot:
                return None
        return snapshot

    def _new(self) -> list[Path]:
        """Folders to load: each model's newest if newer than all loaded, and the versions
        configuration names (experiment, pin) that are not loaded yet."""
        registry = self._registry
        found = []
        for name, versions in discover_models(self._models_dir).items():
            loaded = registry.versions(name)
            wanted = registry.in_use(name)
            for path in versions:
                newest = path is versions[-1] and (
                    not loaded or version_key(path.name) > version_key(loaded[-1])
                )
                if path.name not in loaded and (newest or path.name in wanted):
                    found.append(path)
        return found

    def _changed(self) -> list[Path]:
        """Loaded versions whose folder holds other files than those they were loaded from."""
        changed = []
        for model in list(self._registry.all()):
            if (model.path / "manifest.json").is_file() and (
                folder_snapshot(model.path) != model.files
            ):
                changed.append(model.path)
        return changed

    async def _add(self, path: Path, snapshot: FolderSnapshot) -> bool:
        registry = self._registry
        name = path.parent.name
        old = self._serving(name)
        try:
            await registry.load(path)
        except Exception as exc:
            self._refuse(path, snapshot, exc, "is not loaded; it is retried once its files change")
            return False
        self._count(name, "loaded")
        new = self._serving(name)
        if new == old:
            log.info("hot reload: %s version %s loaded; version %s serves on", name, path.name, old)
            return True
        self.swaps += 1
        log.info("hot reload: %s now serves version %s (was %s)", name, new, old)
        if old is not None and old not in registry.in_use(name):
            await registry.unload(name, old, self.drain_s)
            log.info("hot reload: %s version %s drained and unloaded", name, old)
        return True

    async def _reload(self, path: Path, snapshot: FolderSnapshot) -> bool:
        name, version = path.parent.name, path.name
        try:
            await self._registry.reload(path, self.drain_s)
        except Exception as exc:
            self._refuse(
                path,
                snapshot,
                exc,
                "changed but its new files do not load; the version serves on from its "
                "previous files until they change again",
            )
            return False
        self.reloads += 1
        self._count(name, "replaced")
        log.info("hot reload: %s version %s reloaded from its changed files", name, version)
        return True

    def _serving(self, name: str) -> str | None:
        try:
            return self._registry.serving_version(name)
        except Exception:  # not loaded, or its configured version is not
            return None

    def _refuse(
        self, path: Path, snapshot: FolderSnapshot, exc: Exception, consequence: str
    ) -> None:
        """Log a refused change once: one line with its reason, the traceback at DEBUG."""
        reason = " ".join(str(exc).split()) or type(exc).__name__
        log.error("hot reload: %s %s: %s", path, consequence, reason)
        log.debug("hot reload: why %s was refused", path, exc_info=exc)
        self._failed[path] = snapshot
        self.refused += 1
        self._count(path.parent.name, "refused")

    def _count(self, model: str, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.count_model_reload(model, outcome)
