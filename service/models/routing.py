"""Which model version answers each request row: the one routing rule of every scoring path.

A row that names a version is answered by that version and stays outside any experiment. A row
that names none is routed by its entity: with an experiment configured for the model, the
experiment's router picks its arm (the champion, or in A/B mode a challenger for the entities
of its share) and whether a shadow copy is scored aside; without one, it goes to the model's
serving version (`ModelRegistry.serving_version`: the champion, else a pinned version, else the
highest). Unary, batch, OIP and stream handlers all ask `RequestRouter` and hand what they
scored back to `RequestRouter.record`, so a challenger never answers a caller it was not given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from service.batching.batcher import Scored
from service.batching.rows import RowBatch
from service.errors import ModelNotFound, Unavailable
from service.explanations.reasons import Explained
from service.models.experiments import Experiments
from service.models.registry import ModelRegistry, ModelVersion
from service.shadow import Route

__all__ = ["Assignment", "Recorder", "RequestRouter"]


class Recorder(Protocol):
    """(model, route per row, request ids, entity ids, rows, scored, latency_s, explained)."""

    def __call__(
        self,
        model: ModelVersion,
        routes: Sequence[Route | None],
        request_ids: Sequence[str],
        entity_ids: Sequence[str],
        rows: RowBatch,
        scored: Scored,
        latency_s: float,
        explained: Explained | None = None,
    ) -> None: ...


def _ignore(*_: object, **__: object) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Assignment:
    """The rows of one request that one model version answers, with each row's route.

    `rows` are positions in the request, ascending; `routes[k]` belongs to `rows[k]` and is
    None for a row outside any experiment (it is neither logged nor shadowed).
    """

    model: ModelVersion
    rows: tuple[int, ...]
    routes: tuple[Route | None, ...]
    routed: bool = False
    """Whether any row is in an experiment (and so logged)."""


class RequestRouter:
    """Routes requests by model, version and entity; records what the experiments log."""

    def __init__(self, registry: ModelRegistry, experiments: Experiments | None = None) -> None:
        self._registry = registry
        self._experiments = experiments
        # Log the routed rows of one scored group and queue their shadow copies; never waits.
        # Rows are routed (their route is not None) only where an experiment runs.
        self.record: Recorder = _ignore if experiments is None else experiments.record

    def model(self, name: str, version: str = "") -> ModelVersion:
        """`version` of `name`, or its serving version: what metadata and readiness report."""
        return self._registry.get(name, version)

    def route_one(
        self, name: str, version: str, entity_id: str
    ) -> tuple[ModelVersion, Route | None]:
        """The version that answers one request, and its experiment route (None: not logged)."""
        if version or self._experiments is None:
            return self._registry.get(name, version), None
        route = self._experiments.router.route(name, entity_id)
        if not route.logged:
            return self._registry.get(name), None
        return self._arm(name, route), route

    def most_rows(self, name: str, version: str) -> int:
        """The most rows one batch request may bring: what the version that answers it takes,
        or, where an experiment splits the rows among versions, what they take together."""
        if version or not self._experimenting(name):
            return self._registry.get(name, version).manifest.max_batch_size
        return sum(
            self._registry.get(name, v).manifest.max_batch_size
            for v in self._registry.versions(name)
        )

    def route_rows(self, name: str, version: str, entity_ids: Sequence[str]) -> list[Assignment]:
        """Rows grouped by the version that answers them, in order of first appearance."""
        rows = tuple(range(len(entity_ids)))
        if version or self._experiments is None or not self._experimenting(name):
            return [Assignment(self._registry.get(name, version), rows, (None,) * len(rows))]
        groups: dict[str, tuple[ModelVersion, list[int], list[Route | None]]] = {}
        for i, entity_id in enumerate(entity_ids):
            route = self._experiments.router.route(name, entity_id)
            key = route.serving_version or ""
            group = groups.get(key)
            if group is None:
                group = groups[key] = (self._arm(name, route), [], [])
            group[1].append(i)
            group[2].append(route if route.logged else None)
        return [
            Assignment(m, tuple(idx), tuple(routes), any(r is not None for r in routes))
            for m, idx, routes in groups.values()
        ]

    def _experimenting(self, name: str) -> bool:
        return self._experiments is not None and bool(self._experiments.router.versions(name)[1:])

    def _arm(self, name: str, route: Route) -> ModelVersion:
        # The champion is the registry's serving version: one rule, one error if not loaded.
        if route.arm == "champion" or not route.serving_version:
            return self._registry.get(name)
        try:
            return self._registry.get(name, route.serving_version)
        except ModelNotFound:  # the caller named no version: the server is misconfigured
            raise Unavailable(
                f"model {name!r}: version {route.serving_version!r} (an A/B challenger) "
                "is not loaded"
            ) from None
