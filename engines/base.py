"""The `Engine` interface every backend implements, and the errors it raises.

Exception tree::

    EngineError
    ├── ShapeMismatch      a tensor's dims fall outside the engine's shape ranges
    ├── EngineUnavailable  the backend cannot be loaded here (library or device missing)
    └── EngineFailure      the backend failed while running a batch
        └── EngineHung     a call ran past the engine time limit (see engines.watchdog)
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DimRange",
    "Engine",
    "EngineError",
    "EngineFailure",
    "EngineHung",
    "EngineUnavailable",
    "Profile",
    "ShapeMismatch",
    "TensorSpec",
]

Arrays = Mapping[str, np.ndarray]


class EngineError(Exception):
    """Base of every error an engine raises."""


class ShapeMismatch(EngineError):
    """A tensor's shape fits none of the engine's accepted shape ranges."""

    def __init__(self, tensor: str, dims: tuple[int, ...], accepted: str) -> None:
        super().__init__(f"tensor {tensor!r} with dims {list(dims)} is outside {accepted}")
        self.tensor = tensor
        self.dims = dims
        self.accepted = accepted


class EngineUnavailable(EngineError):
    """The backend's library or device is not present on this machine."""


class EngineFailure(EngineError):
    """The backend raised or returned an error while running a batch."""


class NonFiniteOutput(EngineFailure):
    """An engine returned NaN or infinity: a broken engine, or rows outside its numeric range."""


class EngineHung(EngineFailure):
    """A call did not return within the engine time limit; its thread may still be running."""


@dataclass(frozen=True, slots=True)
class DimRange:
    """Inclusive range of one dimension; `max_value=None` means unbounded."""

    min_value: int
    opt_value: int
    max_value: int | None

    def contains(self, value: int) -> bool:
        return value >= self.min_value and (self.max_value is None or value <= self.max_value)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, element type and per-dimension ranges of one input tensor."""

    name: str
    dtype: str
    dims: tuple[DimRange, ...]

    def fits(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.dims) and all(
            d.contains(v) for d, v in zip(self.dims, shape, strict=True)
        )

    def describe(self) -> str:
        parts = [
            f"{d.min_value}..{'inf' if d.max_value is None else d.max_value}" for d in self.dims
        ]
        return "[" + ", ".join(parts) + "]"


@dataclass(frozen=True, slots=True)
class Profile:
    """One optimization profile: a shape range for every input tensor."""

    index: int
    inputs: tuple[TensorSpec, ...]

    def fits(self, shapes: Mapping[str, tuple[int, ...]]) -> bool:
        return all(spec.fits(shapes[spec.name]) for spec in self.inputs if spec.name in shapes)

    @property
    def max_batch_size(self) -> int | None:
        """Largest leading (batch) dimension any input accepts in this profile."""
        limits = [spec.dims[0].max_value for spec in self.inputs if spec.dims]
        if any(v is None for v in limits):
            return None
        return min(v for v in limits if v is not None) if limits else None


class Engine(ABC):
    """A loaded executable for one model: `infer()` on numpy arrays.

    Subclasses implement `_infer`; `infer` checks shapes against the profiles first so a batch
    that does not fit raises `ShapeMismatch` before any work is enqueued.
    """

    #: short identifier such as ``tensorrt-fp16`` or ``onnxruntime-cpu``
    name: str
    #: ``tensorrt`` or ``onnxruntime``
    kind: str
    #: ``fp32``, ``fp16`` or ``int8``
    precision: str
    #: accepted shape ranges; an engine with dynamic axes has one unbounded profile
    profiles: tuple[Profile, ...]
    #: how many batches may run at once (execution contexts, session threads)
    max_concurrency: int = 1
    #: whether a call can block without bound (a GPU stream or driver can); the batcher runs
    #: only engines that cannot on its event loop, and only those skip the watchdog
    can_hang: bool = True

    def select_profile(self, shapes: Mapping[str, tuple[int, ...]]) -> Profile:
        """The first profile that accepts every shape, else `ShapeMismatch`."""
        for profile in self.profiles:
            if profile.fits(shapes):
                return profile
        # Name the first tensor that no profile accepts, which is what a caller must change.
        for name, dims in shapes.items():
            specs = [s for p in self.profiles for s in p.inputs if s.name == name]
            if specs and not any(s.fits(dims) for s in specs):
                raise ShapeMismatch(name, dims, " or ".join(s.describe() for s in specs))
        name, dims = next(iter(shapes.items()))
        raise ShapeMismatch(name, dims, "no single profile accepting all inputs together")

    @property
    def max_batch_size(self) -> int | None:
        """The largest batch any profile accepts (None: unbounded)."""
        sizes = [p.max_batch_size for p in self.profiles]
        if any(s is None for s in sizes):
            return None
        return max(s for s in sizes if s is not None)

    def infer(self, inputs: Arrays) -> dict[str, np.ndarray]:
        shapes = {name: tuple(int(d) for d in arr.shape) for name, arr in inputs.items()}
        profile = self.select_profile(shapes)
        return self._infer(inputs, profile)

    def timed_infer(self, inputs: Arrays) -> tuple[dict[str, np.ndarray], float]:
        """`infer` plus its duration in seconds on a monotonic clock."""
        start = time.perf_counter()
        outputs = self.infer(inputs)
        return outputs, time.perf_counter() - start

    @abstractmethod
    def _infer(self, inputs: Arrays, profile: Profile) -> dict[str, np.ndarray]:
        """Run one batch whose shapes fit `profile`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release device memory, sessions and threads."""
