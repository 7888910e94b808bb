"""The models this process serves: lookups, the serving version, and load, reload and unload.

Version folders are found by `service.models.folders` and built by `service.models.loader`
(off the event loop, in the executor). A request that names no version is answered by the
model's serving version (`ModelRegistry.serving_version`): the experiment's champion when an
experiment is configured, else the version pinned in configuration, else the highest loaded.
Versions are loaded and warmed beside what serves; a version reloaded in place is swapped in
one step on the event loop. A model whose serving version is not loaded is not ready: the
registry logs why at ERROR and tells its readiness listeners (health) whenever that may change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import Protocol

from service.errors import ModelNotFound, Unavailable
from service.models.folders import discover_models, folder_snapshot, version_key
from service.models.loader import VersionLoader, settle_heap
from service.models.version import ModelVersion
from service.telemetry import Telemetry

__all__ = ["ModelRegistry", "ModelVersion", "ReadinessListener", "ServingPreference"]

log = logging.getLogger(__name__)

ReadinessListener = Callable[[Mapping[str, bool]], Awaitable[None]]
"""Awaited with each model's name and whether its serving version is loaded."""


class ServingPreference(Protocol):
    """Where the experiments say which version serves (`ExperimentRouter` is one)."""

    def champion(self, model: str) -> str | None: ...

    def versions(self, model: str) -> tuple[str, ...]: ...

    def models(self) -> tuple[str, ...]: ...


class ModelRegistry:
    """The models this process serves, keyed by name, each with a serving version."""

    def __init__(
        self,
        executor: Executor,
        loader: VersionLoader,
        *,
        telemetry: Telemetry | None = None,
        pinned_versions: Mapping[str, str] | None = None,
        required: Iterable[str] = (),
    ) -> None:
        """`loader` builds versions on `executor`'s threads; `required` names models that must
        serve though none of their versions loaded (the default model)."""
        self._executor = executor
        self._loader = loader
        if telemetry is not None:
            telemetry.metrics.set_queue_depth_callback(self.queue_depths)
        self._versions: dict[str, dict[str, ModelVersion]] = {}
        self._highest: dict[str, str] = {}
        self._pinned = dict(pinned_versions or {})
        self._required = frozenset(required)
        self._experiments: ServingPreference | None = None
        self._reload_listeners: list[Callable[[str, str], None]] = []
        self._readiness_listeners: list[ReadinessListener] = []
        # What each model was last said to serve: its version, or why none (None: not told yet).
        self._told: dict[str, str] | None = None
        self._loaded = False

    def follow(self, experiments: ServingPreference) -> None:
        """Serve each model's experiment champion to requests that name no version."""
        self._experiments = experiments

    def on_reload(self, listener: Callable[[str, str], None]) -> None:
        """Call `listener(name, version)` whenever a loaded version is swapped for new files."""
        self._reload_listeners.append(listener)

    def on_readiness(self, listener: ReadinessListener) -> None:
        """Await `listener(ready by model)` at each `check_readiness`."""
        self._readiness_listeners.append(listener)

    # -- lookups (event loop) -------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._versions)

    def versions(self, name: str) -> list[str]:
        return sorted(self._versions.get(name, {}), key=version_key)

    def preferred_version(self, name: str) -> tuple[str, str] | None:
        """The version configuration names to serve `name`, and which setting names it."""
        if self._experiments is not None:
            champion = self._experiments.champion(name)
            if champion is not None:
                return champion, "the experiment's champion"
        pinned = self._pinned.get(name)
        return None if pinned is None else (pinned, "pinned in the settings")

    def serving_version(self, name: str) -> str:
        """The version that answers requests naming none: champion, else pinned, else highest.

        A configured version that is not loaded is an error (UNAVAILABLE), never a reason to
        serve another: the highest may be a challenger.
        """
        versions = self._versions.get(name)
        if not versions:
            raise ModelNotFound(f"model {name!r} is not loaded")
        preferred = self.preferred_version(name)
        if preferred is None:
            return self._highest[name]
        version, why = preferred
        if version not in versions:
            raise Unavailable(f"model {name!r}: version {version!r} ({why}) is not loaded")
        return version

    def expected(self) -> list[str]:
        """The models that must serve: those loaded, and those the settings pin a version of,
        require (the default model) or an experiment names, loaded or not."""
        named = set(self._pinned) | self._required
        if self._experiments is not None:
            named.update(self._experiments.models())
        return sorted(named.union(self._versions))

    def not_ready(self) -> dict[str, str]:
        """Each expected model whose serving version is not loaded, with the reason."""
        reasons = {}
        for name in self.expected():
            try:
                self.serving_version(name)
            except (Unavailable, ModelNotFound) as exc:
                reasons[name] = str(exc)
        return reasons

    @property
    def ready(self) -> bool:
        """The models are loaded, and each one's serving version with them (OIP ServerReady)."""
        return self._loaded and not self.not_ready()

    async def check_readiness(self) -> None:
        """Log each model's serving version, or at ERROR why it has none, where that changed
        since the last check; then tell the readiness listeners.

        The server calls it once the experiments file is read; from then on every load and
        unload calls it, and so does the experiments watcher when the file changes.
        """
        told, self._told = self._told or {}, {}
        unready = self.not_ready()
        expected = self.expected()
        for name in expected:
            state = self._told[name] = unready.get(name) or self.serving_version(name)
            if told.get(name) == state:
                continue
            if name in unready:
                log.error(
                    "%s: requests naming no version fail, and health reports NOT_SERVING, "
                    "until it is loaded",
                    state,
                )
            else:
                preferred = self.preferred_version(name)
                why = "the highest loaded" if preferred is None else preferred[1]
                log.info("%s: version %s serves (%s)", name, state, why)
        ready = {name: name not in unready for name in expected}
        for listener in self._readiness_listeners:
            await listener(ready)

    def in_use(self, name: str) -> set[str]:
        """Versions of `name` that must stay loaded: what serves and what configuration names."""
        held = set(self._experiments.versions(name)) if self._experiments is not None else set()
        if name in self._pinned:
            held.add(self._pinned[name])
        if name in self._highest and self.preferred_version(name) is None:
            held.add(self._highest[name])
        return held

    def get(self, name: str, version: str = "") -> ModelVersion:
        """`version` of model `name`; its serving version when `version` is empty."""
        versions = self._versions.get(name)
        if not versions:
            raise ModelNotFound(f"model {name!r} is not loaded")
        try:
            return versions[version or self.serving_version(name)]
        except KeyError:
            raise ModelNotFound(f"model {name!r} has no version {version!r} loaded") from None

    def queue_depths(self) -> dict[tuple[str, str], int]:
        """Rows waiting per (model, version), read by the queue-depth gauge."""
        return {(m.name, m.version): m.batcher.queued_rows for m in list(self.all())}

    def all(self) -> Iterator[ModelVersion]:
        for versions in self._versions.values():
            yield from versions.values()

    # -- loading ------------------------------------------------------------------------

    async def load_dir(self, models_dir: Path) -> None:
        """Load every model version found under `models_dir`. A version that does not load is
        logged at ERROR with its reason and left out: one bad version stops no other from
        serving. Raises `Unavailable` where no version loads."""
        found = discover_models(models_dir)
        if not found:
            raise Unavailable(f"no model with a manifest.json under {models_dir}")
        refused = []
        for versions in found.values():
            for path in versions:
                try:
                    await self.load(path)
                except Exception as exc:
                    reason = str(exc) if str(path) in str(exc) else f"{path}: {exc}"
                    log.error("not served: %s", reason)
                    log.debug("why %s did not load", path, exc_info=True)
                    refused.append(reason)
        if not any(self._versions.values()):
            raise Unavailable("no model version loads: " + "; ".join(refused))
        self._loaded = True

    async def load(self, path: Path) -> ModelVersion:
        """Load and warm a version folder not loaded yet; it serves only as the rule says."""
        if path.name in self._versions.get(path.parent.name, {}):
            raise ValueError(f"{path.parent.name} version {path.name} is loaded; reload it")
        model = await self._load(path)
        self._versions.setdefault(model.name, {})[model.version] = model
        self._update_highest(model.name)
        await self._recheck()
        return model

    async def reload(self, path: Path, drain_s: float) -> ModelVersion:
        """Load a loaded version's changed files beside it, swap them in, retire the old.

        Requests that hold the old instance finish on it; if the new files do not load, the
        error propagates and the old instance serves on.
        """
        name, version = path.parent.name, path.name
        old = self.get(name, version)
        model = await self._load(path)
        self._versions[name][version] = model  # one step on the event loop
        for listener in self._reload_listeners:
            listener(name, version)
        await self._retire(old, drain_s)
        return model

    async def unload(self, name: str, version: str, drain_s: float) -> None:
        """Drain and drop a version that neither serves nor is named by configuration."""
        if version in self.in_use(name):
            raise ValueError(f"{name} {version} serves or is configured; it stays loaded")
        model = self._versions[name].pop(version)
        if self._versions[name]:
            self._update_highest(name)
        else:
            del self._versions[name], self._highest[name]
        await self._recheck()
        await self._retire(model, drain_s)

    async def _recheck(self) -> None:
        # Before the first check (the models still loading) there is nothing to tell yet.
        if self._told is not None:
            await self.check_readiness()

    async def _load(self, path: Path) -> ModelVersion:
        files = folder_snapshot(path)  # before reading: a change during the load shows later
        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(self._executor, self._loader.build, path)
        model.files = files
        settle_heap()
        model.batcher.start()
        return model

    def _update_highest(self, name: str) -> None:
        self._highest[name] = max(self._versions[name], key=version_key)

    @staticmethod
    async def _retire(model: ModelVersion, drain_s: float) -> None:
        # Requests that looked `model` up in this turn of the event loop (a split batch submits
        # from tasks that start on the next turn) are queued before its batcher stops admitting.
        await asyncio.sleep(0)
        started = time.monotonic()
        await model.until_released(drain_s)
        await model.batcher.close(max(0.0, drain_s - (time.monotonic() - started)))
        for engine in model.engines():
            engine.close()

    async def close(self, drain_s: float) -> None:
        await asyncio.gather(*(m.batcher.close(drain_s) for m in self.all()))
        for model in self.all():
            for engine in model.engines():
                engine.close()
