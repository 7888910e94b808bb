"""`OnnxRuntimeEngine`: an `Engine` over one ONNX Runtime session (CPU or CUDA)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import (
    DimRange,
    Engine,
    EngineFailure,
    Profile,
    ShapeMismatch,
    TensorSpec,
)
from engines.manifest import Manifest
from engines.onnxrt.loader import CUDA, SessionFromPath
from engines.output import ScoreOutput, resolve_score_output

__all__ = ["OnnxRuntimeEngine"]

_ORT_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(bool)": "bool",
}
_BAD_DIMS = re.compile(r"invalid dimensions for input: (\S+)")


def _dim_range(dim: object) -> DimRange:
    # A named or missing dim is dynamic: ONNX Runtime accepts any positive size there.
    if isinstance(dim, int) and dim > 0:
        return DimRange(dim, dim, dim)
    return DimRange(1, 1, None)


def _profile_from_session(session: Any) -> Profile:
    specs = tuple(
        TensorSpec(
            name=arg.name,
            dtype=_ORT_DTYPES.get(arg.type, arg.type),
            dims=tuple(_dim_range(d) for d in arg.shape),
        )
        for arg in session.get_inputs()
    )
    return Profile(index=0, inputs=specs)


class OnnxRuntimeEngine(Engine):
    """Runs one ONNX model with ONNX Runtime; one unbounded profile from the model's dims.

    ONNX Runtime sessions are safe to `run` from several threads at once, so
    `max_concurrency` is how many runs the caller may keep in flight together.
    """

    kind = "onnxruntime"

    def __init__(
        self,
        session: Any,
        *,
        precision: str = "fp32",
        output_names: Sequence[str] | None = None,
        max_concurrency: int = 2,
    ) -> None:
        self._session = session
        self.precision = precision
        providers = tuple(session.get_providers())
        self.providers = providers
        device = "cuda" if providers and providers[0] == CUDA else "cpu"
        suffix = "" if precision == "fp32" else f"-{precision}"
        self.name = f"onnxruntime-{device}{suffix}"
        # On the CPU a run is ordinary compute on the calling thread: it returns or raises.
        self.can_hang = device != "cpu"
        self.profiles = (_profile_from_session(session),)
        self._dtypes = {s.name: s.dtype for s in self.profiles[0].inputs}
        self._outputs = (
            list(output_names)
            if output_names is not None
            else [o.name for o in session.get_outputs()]
        )
        self.max_concurrency = max_concurrency

    @classmethod
    def from_path(
        cls,
        path: Path,
        *,
        precision: str = "fp32",
        providers: Sequence[str] | None = None,
        intra_op_threads: int = 1,
        max_concurrency: int = 2,
        require_providers: bool = False,
    ) -> OnnxRuntimeEngine:
        session = SessionFromPath(
            path,
            providers=providers,
            intra_op_threads=intra_op_threads,
            require_providers=require_providers,
        )()
        return cls(session, precision=precision, max_concurrency=max_concurrency)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path,
        manifest: Manifest,
        *,
        precision: str = "fp32",
        providers: Sequence[str] | None = None,
        intra_op_threads: int = 1,
        max_concurrency: int = 2,
        score: ScoreOutput | None = None,
    ) -> OnnxRuntimeEngine:
        """The engine for one precision of a model folder (fp32 is ``model.onnx``), fetching
        the tensor that holds the score (`score`, resolved from ``model.onnx`` where not
        given)."""
        if score is None:
            score = resolve_score_output(model_dir / "model.onnx", manifest)
        file = "model.onnx" if precision == "fp32" else manifest.variants[precision]
        session = SessionFromPath(
            model_dir / file,
            providers=providers,
            intra_op_threads=intra_op_threads,
            extra_outputs=score.extra_outputs,
        )()
        return cls(
            session,
            precision=precision,
            output_names=[score.tensor],
            max_concurrency=max_concurrency,
        )

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.profiles[0].inputs)

    def _feed(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self._dtypes if n not in inputs]
        if missing:
            raise EngineFailure(f"{self.name}: missing inputs {missing}")
        return {
            name: np.ascontiguousarray(inputs[name], dtype=np.dtype(dtype))
            for name, dtype in self._dtypes.items()
        }

    def _infer(self, inputs: Mapping[str, np.ndarray], profile: Profile) -> dict[str, np.ndarray]:
        feed = self._feed(inputs)
        try:
            results = self._session.run(self._outputs, feed)
        except Exception as exc:
            raise self._map_error(exc, feed) from exc
        return dict(zip(self._outputs, results, strict=True))

    def _map_error(self, exc: Exception, feed: Mapping[str, np.ndarray]) -> Exception:
        # ONNX Runtime's exception classes derive from Exception only; the kind is in the name.
        kind = type(exc).__name__
        match = _BAD_DIMS.search(str(exc))
        if kind == "InvalidArgument" and match:
            tensor = match.group(1)
            dims = tuple(feed[tensor].shape) if tensor in feed else ()
            specs = [s for s in self.profiles[0].inputs if s.name == tensor]
            accepted = specs[0].describe() if specs else "the model's input dims"
            return ShapeMismatch(tensor, dims, accepted)
        return EngineFailure(f"{self.name}: {kind} while running the session")

    def close(self) -> None:
        self._session = None
