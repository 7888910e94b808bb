"""Experiment configuration and the router that picks an arm for each request.

Routing is a pure function of (salt, model, entity_id) through BLAKE2b, so every replica and
every restart sends the same entity to the same arm. Python's ``hash()`` is salted per process
and must never be used here.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from service.shadow.errors import ExperimentConfigError

__all__ = [
    "ExperimentConfig",
    "ExperimentRouter",
    "ModelExperiment",
    "Route",
    "stable_unit_interval",
]

Arm = Literal["champion", "challenger"]
Mode = Literal["shadow", "ab"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelExperiment(_Frozen):
    """One model's experiment: which version serves, which are tried, and how."""

    champion: str = Field(description="Version served by default and the baseline of every report.")
    challengers: tuple[str, ...] = Field(
        default=(), description="Versions under evaluation; empty means no experiment runs."
    )
    mode: Mode = Field(
        "shadow",
        description="shadow: challengers score a copy off the hot path; ab: they serve a share.",
    )
    shadow_share: float = Field(
        1.0, ge=0.0, le=1.0, description="Share of entities whose requests get a shadow copy."
    )
    ab_share: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of entities served by a challenger (ab mode)."
    )
    log_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Sub-folder under the log prefix for this experiment; the model name if unset.",
    )
    salt: str = Field("", description="Mixed into the hash; change it to reshuffle the buckets.")

    @model_validator(mode="after")
    def _distinct(self) -> ModelExperiment:
        if self.champion in self.challengers:
            raise ValueError("the champion version cannot also be a challenger")
        if len(set(self.challengers)) != len(self.challengers):
            raise ValueError("challenger versions must be distinct")
        return self


class ExperimentConfig(_Frozen):
    """Every running experiment, keyed by model name."""

    models: dict[str, ModelExperiment] = Field(default_factory=dict)

    @classmethod
    def from_json_file(cls, path: Path) -> ExperimentConfig:
        """Read a config written as JSON (``{"models": {"fraud-demo": {...}}}``)."""
        try:
            text = path.read_text()
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ExperimentConfigError(f"experiments file {path}: {reason}") from exc
        try:
            return cls.model_validate(json.loads(text))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in error['loc']) or 'the file'}: {error['msg']}"
                for error in exc.errors()
            )
            raise ExperimentConfigError(f"experiments file {path}: {problems}") from None
        except ValueError as exc:  # not JSON: the decoder names the line and column
            raise ExperimentConfigError(f"experiments file {path}: not JSON: {exc}") from None


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes: the version that answers it and the versions scored aside."""

    serving_version: str | None
    shadow_versions: tuple[str, ...] = ()
    arm: Arm = "champion"
    mode: Mode = "shadow"
    experiment: str | None = None
    """Log name of the experiment; None when the model has none and nothing is logged."""

    @property
    def logged(self) -> bool:
        return self.experiment is not None


_NO_EXPERIMENT = Route(serving_version=None)


def stable_unit_interval(*parts: str) -> float:
    """Map strings to a float in [0, 1) that is identical in every process and on every host."""
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass(frozen=True, slots=True)
class _Plan:
    """One model's experiment made ready to route: its hash prefix and its few routes."""

    share: float
    prefix: str
    """The hashed text before the entity id: (mode, salt, model) joined as stable_unit_interval
    joins them, so a bucket is the same as ``stable_unit_interval(mode, salt, model, entity)``."""
    inside: tuple[Route, ...]
    """Shadow mode: the shadowed champion route; A/B mode: one route per challenger."""
    outside: Route
    """The route of entities outside the share (and, in A/B mode, of requests naming none)."""
    anonymous_inside: bool

    @classmethod
    def of(cls, model: str, experiment: ModelExperiment) -> _Plan | Route:
        """The plan of a running experiment, or the one route of an experiment without one."""
        if not experiment.challengers:
            return Route(experiment.champion)
        log_name = experiment.log_name or model
        prefix = "\x1f".join((experiment.mode, experiment.salt, model, ""))
        champion = experiment.champion
        if experiment.mode == "ab":
            return cls(
                experiment.ab_share,
                prefix,
                tuple(Route(v, (), "challenger", "ab", log_name) for v in experiment.challengers),
                Route(champion, (), "champion", "ab", log_name),
                anonymous_inside=False,
            )
        return cls(
            experiment.shadow_share,
            prefix,
            (Route(champion, experiment.challengers, "champion", "shadow", log_name),),
            Route(champion, (), "champion", "shadow", log_name),
            anonymous_inside=True,
        )


class ExperimentRouter:
    """Holds the current config; `update` swaps it atomically while requests are being routed."""

    def __init__(self, config: ExperimentConfig | None = None) -> None:
        self._state = _prepare(config or ExperimentConfig())
        self._update_lock = threading.Lock()

    @property
    def config(self) -> ExperimentConfig:
        return self._state[0]

    def update(self, config: ExperimentConfig) -> None:
        # One reference assignment: a concurrent route() sees the old or the new config whole.
        with self._update_lock:
            self._state = _prepare(config)

    def champion(self, model: str) -> str | None:
        """The version that answers `model`'s requests naming none; None without an experiment."""
        experiment = self._state[0].models.get(model)
        return None if experiment is None else experiment.champion

    def versions(self, model: str) -> tuple[str, ...]:
        """Every version `model`'s experiment names, the champion first."""
        experiment = self._state[0].models.get(model)
        return () if experiment is None else (experiment.champion, *experiment.challengers)

    def models(self) -> tuple[str, ...]:
        """Every model an experiment names."""
        return tuple(self._state[0].models)

    def route(self, model: str, entity_id: str) -> Route:
        plan = self._state[1].get(model)
        if plan is None:
            return _NO_EXPERIMENT
        if isinstance(plan, Route):
            return plan
        # A/B shares are drawn over entities: a request that names none is no entity's, and one
        # bucket for all of them would hand every anonymous request to the same arm.
        if not entity_id and not plan.anonymous_inside:
            return plan.outside
        digest = hashlib.blake2b((plan.prefix + entity_id).encode(), digest_size=8).digest()
        bucket = int.from_bytes(digest, "big") / 2.0**64
        if bucket >= plan.share:
            return plan.outside
        # An A/B share is split evenly among the challengers, in their listed order.
        index = int(bucket / plan.share * len(plan.inside))
        return plan.inside[min(index, len(plan.inside) - 1)]


def _prepare(config: ExperimentConfig) -> tuple[ExperimentConfig, dict[str, _Plan | Route]]:
    return config, {model: _Plan.of(model, e) for model, e in config.models.items()}
