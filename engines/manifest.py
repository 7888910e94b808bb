"""A model's manifest: what its ONNX file expects and how its scores become decisions.

A model lives in ``models/<name>/<version>/`` with ``model.onnx`` and ``manifest.json``. The
manifest is read once at load time and is the single source for validation, padding,
thresholds, optimization profiles and precision tolerances.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "Explanations",
    "FeatureBounds",
    "FeatureExplanation",
    "HistoryExplanation",
    "HistorySpec",
    "Manifest",
    "ProfileSpec",
    "ReasonCode",
    "Thresholds",
    "Tolerance",
    "load_manifest",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _no_repeats(names: tuple[str, ...]) -> tuple[str, ...]:
    # A name stands for one column: a request's features are found by name, and a repeated
    # name leaves the codec unable to fill the row, so every request would be refused.
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{name!r} is named more than once")
        seen.add(name)
    return names


#: Names of the columns of a tensor, in order, each once.
_Names = Annotated[tuple[str, ...], AfterValidator(_no_repeats)]


class HistorySpec(_Frozen):
    """The variable-length sequence of an entity's recent events."""

    input: str = Field(
        "history", description="ONNX input name of the (batch, length, fields) tensor."
    )
    mask_input: str = Field(
        "history_mask", description="ONNX input name of the (batch, length) 1/0 validity mask."
    )
    fields: _Names = Field(description="Names of the per-row fields, in tensor order.")
    max_length: int = Field(gt=0, description="Hard limit on rows a request may carry.")
    min_padded_length: int = Field(
        1, ge=1, description="Batches are padded to at least this many rows (models need T >= 1)."
    )
    broadcast: bool = Field(
        False,
        description=(
            "The model scores any number of feature rows against a history batch of one (the "
            "history's terms broadcast over the features' batch), so an explained request's "
            "history is computed once; checked when the model loads."
        ),
    )


class Thresholds(_Frozen):
    """Score cut-offs: below `review` approves, from `review` reviews, from `decline` declines."""

    review: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    decline: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> Thresholds:
        if self.decline < self.review:
            raise ValueError(
                f"thresholds.decline {self.decline} is below thresholds.review {self.review}"
            )
        return self

    def decide(self, score: float) -> str:
        if score >= self.decline:
            return "DECLINE"
        if score >= self.review:
            return "REVIEW"
        return "APPROVE"


def _profile_range(rng: tuple[int, int, int]) -> tuple[int, int, int]:
    # Checked as the manifest loads, where the error names the entry: the batch's max caps the
    # rows a version batches on any host, and a range out of order would otherwise surface
    # only when plans are built, or as a shape error naming no field.
    low, opt, high = rng
    if not 1 <= low <= opt <= high:
        raise ValueError(f"[{low}, {opt}, {high}] is not 1 <= min <= opt <= max")
    return rng


#: A min/opt/max range of one dimension of a profile.
_ProfileRange = Annotated[tuple[int, int, int], AfterValidator(_profile_range)]


class ProfileSpec(_Frozen):
    """One TensorRT optimization profile: min/opt/max of batch size and history length."""

    batch: _ProfileRange
    history_length: _ProfileRange | None = None


class Tolerance(_Frozen):
    """How far a reduced-precision variant may stray from FP32 before it is refused."""

    # Finite, or every variant would pass: a comparison with NaN is always false.
    max_abs_error: float = Field(0.05, ge=0.0, allow_inf_nan=False)
    auc_drop: float = Field(0.005, ge=0.0, allow_inf_nan=False)
    flip_rate: float = Field(0.01, ge=0.0, allow_inf_nan=False)


_CODE_PATTERN = r"^[A-Za-z0-9_.-]{1,32}$"


class FeatureExplanation(_Frozen):
    """A feature's baseline and the reason code it is reported under."""

    baseline: float | None = Field(
        None, description="Value that stands for 'nothing unusual' (e.g. the population median)."
    )
    code: str | None = Field(
        None, pattern=_CODE_PATTERN, description="Reason code; features may share one."
    )
    text: str | None = Field(
        None, min_length=1, description="The code's text; needed once per code, equal if repeated."
    )


class HistoryExplanation(_Frozen):
    """The history as one group: occluded by replacing it with an empty history."""

    baseline: Literal["empty"] = Field(
        "empty", description="empty: no rows (all masked), what the model sees for new accounts."
    )
    code: str = Field(pattern=_CODE_PATTERN)
    text: str | None = Field(None, min_length=1)


class Explanations(_Frozen):
    """Baselines and reason codes for occlusion reasons (see docs/explanations.md)."""

    features: dict[str, FeatureExplanation] = Field(default_factory=dict)
    history: HistoryExplanation | None = None


class ReasonCode(_Frozen):
    """One code as it is explained: its features, occluded together, and their baselines."""

    code: str
    text: str
    features: tuple[str, ...]  # manifest order
    baselines: tuple[float, ...]
    history: bool


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _reason_codes(manifest: Manifest) -> tuple[ReasonCode, ...]:
    """Check the explanations against the features and group them by code, sorted by code."""
    spec = manifest.explanations
    if spec is None:
        return ()
    known = set(manifest.features)
    unknown = sorted(set(spec.features) - known)
    if unknown:
        raise ValueError(f"explanations.features[{unknown[0]!r}]: not a feature of this model")
    if spec.history is not None and manifest.history is None:
        raise ValueError("explanations.history: this model takes no history")
    members: dict[str, list[tuple[str, FeatureExplanation | HistoryExplanation]]] = {}
    for name in manifest.features:
        entry = spec.features.get(name)
        if entry is None:
            continue
        # As the occlusion rows hold it, in float32: 1e39 is finite only in float64.
        if entry.baseline is not None and not abs(entry.baseline) <= _FLOAT32_MAX:
            # Every occlusion would score NaN, and every request would get no reasons.
            raise ValueError(
                f"explanations.features[{name!r}].baseline: {entry.baseline} is not a finite number"
                " in float32"
            )
        if entry.code is None:
            if entry.text is not None:
                raise ValueError(f"explanations.features[{name!r}].text: given without a code")
            continue
        if entry.baseline is None:
            raise ValueError(
                f"explanations.features[{name!r}]: code {entry.code!r} needs a baseline"
            )
        members.setdefault(entry.code, []).append((name, entry))
    if spec.history is not None:
        members.setdefault(spec.history.code, []).append(("history", spec.history))
    codes = []
    for code in sorted(members):
        texts = {e.text for _, e in members[code] if e.text is not None}
        if not texts:
            raise ValueError(f"explanations: code {code!r} has no text")
        if len(texts) > 1:
            raise ValueError(f"explanations: code {code!r} has conflicting texts {sorted(texts)}")
        features = tuple(n for n, e in members[code] if isinstance(e, FeatureExplanation))
        codes.append(
            ReasonCode(
                code=code,
                text=texts.pop(),
                features=features,
                baselines=tuple(spec.features[n].baseline or 0.0 for n in features),
                history=any(isinstance(e, HistoryExplanation) for _, e in members[code]),
            )
        )
    return tuple(codes)


@dataclass(frozen=True, eq=False)
class FeatureBounds:
    """Per-feature low and high bounds in feature order (float32; -inf and +inf where no range
    is declared). Compared by identity, so a manifest that has built its bounds still compares
    equal to one that has not."""

    low: np.ndarray
    high: np.ndarray


class Manifest(_Frozen):
    """Everything the server needs to know about one model version besides its weights."""

    name: str
    version: str
    description: str = ""
    features_input: str = Field("features", description="ONNX input name of the (batch, n) tensor.")
    features: _Names = Field(min_length=1, description="Tabular feature names in order.")
    history: HistorySpec | None = None
    output: str = Field(
        "score",
        description=(
            "ONNX output holding the risk probability: one per row ([N] or [N, 1]), or a "
            "class-probability output ([N, K] tensor, or a ZipMap sequence of maps) whose "
            "`risk_class` is the score."
        ),
    )
    risk_class: int | str | None = Field(
        None,
        description=(
            "The class whose probability is the risk score, for an output of several classes: "
            "a label the model declares (its classifier or ZipMap node), else a column index."
        ),
    )
    nan_policy: Literal["reject", "zero"] = Field(
        "reject", description="reject: NaN/Inf is INVALID_ARGUMENT; zero: replaced by 0."
    )
    thresholds: Thresholds
    fallback_decision: Literal["APPROVE", "REVIEW", "DECLINE"] = Field(
        "REVIEW", description="Decision given when a request is degraded (no score in time)."
    )
    max_batch_size: int = Field(256, gt=0, description="Most rows one ScoreBatch may carry.")
    profiles: dict[str, tuple[ProfileSpec, ...]] = Field(
        default_factory=dict, description="TensorRT profiles per precision (fp32, fp16, int8)."
    )
    variants: dict[str, str] = Field(
        default_factory=dict, description="Precision -> ONNX file name, besides fp32 model.onnx."
    )
    calibration: str | None = Field(None, description="npz file of representative inputs.")
    tolerance: Tolerance = Tolerance.model_validate({})
    explanations: Explanations | None = Field(
        None, description="Baselines and reason codes; without them requests get no reasons."
    )

    @model_validator(mode="after")
    def _explanations_valid(self) -> Manifest:
        _reason_codes(self)
        return self

    feature_ranges: dict[str, tuple[float, float]] = Field(
        default_factory=dict,
        description="Valid [low, high] per feature name; a value outside is INVALID_ARGUMENT.",
    )

    @model_validator(mode="after")
    def _known_ranges(self) -> Manifest:
        unknown = sorted(set(self.feature_ranges) - set(self.features))
        if unknown:
            raise ValueError(f"feature_ranges names unknown features: {', '.join(unknown)}")
        for name, (low, high) in self.feature_ranges.items():
            if np.isnan(low) or np.isnan(high):
                raise ValueError(f"feature_ranges[{name!r}]: [{low}, {high}] holds a NaN")
            if not low <= high:
                raise ValueError(f"feature_ranges[{name!r}]: low {low} is above high {high}")
            if low == np.inf or high == -np.inf:
                raise ValueError(f"feature_ranges[{name!r}]: [{low}, {high}] admits no value")
        return self

    @property
    def n_features(self) -> int:
        return len(self.features)

    @property
    def reason_codes(self) -> tuple[ReasonCode, ...]:
        """The declared reason codes, sorted by code (empty when none are declared)."""
        return _reason_codes(self)

    @cached_property
    def feature_bounds(self) -> FeatureBounds | None:
        """The declared ranges as arrays for a vectorized check; None when there are none."""
        if not self.feature_ranges:
            return None
        low = np.full(self.n_features, -np.inf, dtype=np.float32)
        high = np.full(self.n_features, np.inf, dtype=np.float32)
        for i, name in enumerate(self.features):
            if name in self.feature_ranges:
                low[i], high[i] = self.feature_ranges[name]
        return FeatureBounds(low, high)


def load_manifest(model_dir: Path) -> Manifest:
    """Read and validate ``manifest.json`` in a model version folder."""
    path = model_dir / "manifest.json"
    return Manifest.model_validate(json.loads(path.read_text()))
