"""`EnginePool`: run a batch on the first engine whose profile fits, else on the fallback.

A batch whose rows do not all fit is split by row: rows whose own history length (from the
mask) fits the engine's profile run there, trimmed to their longest row; the rest run on the
fallback (ONNX Runtime); outputs are put back in the original row order. A history input of one
row in a batch of several feature rows (a model that broadcasts its history, `history.broadcast`
in the manifest) is every row's history, and goes whole with any split or chunk of the rows.

Faults: an engine that raises `EngineFailure`, or returns NaN or infinite outputs (the inputs
were validated finite, so that is the engine's fault, e.g. an FP16 overflow), has that batch
served by the fallback and the error counted; `max_consecutive_errors` in a row take it out of
the pool. An engine that hangs (`EngineHung`, from `engines.watchdog`) is taken out at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from engines.base import (
    Engine,
    EngineFailure,
    EngineHung,
    NonFiniteOutput,
    Profile,
    ShapeMismatch,
)
from engines.manifest import Manifest

__all__ = [
    "REDUCED_PRECISION_MARGIN",
    "CalibrationReport",
    "EngineHealth",
    "EnginePool",
    "PoolResult",
    "rank_engines",
]

Arrays = Mapping[str, np.ndarray]

REDUCED_PRECISION_MARGIN = 1.05
"""How much faster (5 %) an FP16 or INT8 engine must measure to rank above an FP32 one."""


@dataclass(frozen=True, slots=True)
class PoolResult:
    """Outputs in input row order, which engine ran the batch, and why any rows fell back.

    `row_engines` names the engine of each row; it differs from `engine_name` only for rows
    split off to the fallback.
    """

    outputs: dict[str, np.ndarray]
    engine_name: str
    fallback_reason: str
    row_engines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class EngineHealth:
    name: str
    healthy: bool
    consecutive_errors: int
    total_errors: int
    last_error: str = ""


@dataclass(frozen=True, slots=True)
class CalibrationReport:
    """Fastest seconds per batch for each engine and batch size it accepts."""

    seconds: dict[str, dict[int, float]]
    order: tuple[str, ...]


def _rows(inputs: Arrays) -> int:
    return len(next(iter(inputs.values())))


def _non_finite(outputs: Arrays) -> str | None:
    """The first floating-point output holding NaN or infinity, by name; None if none does."""
    for name, value in outputs.items():
        array = np.asarray(value)
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            return name
    return None


def _shapes(inputs: Arrays) -> dict[str, tuple[int, ...]]:
    return {name: tuple(int(d) for d in a.shape) for name, a in inputs.items()}


def _take(inputs: Arrays, rows: np.ndarray | slice) -> dict[str, np.ndarray]:
    """`rows` of every input; an input of one row in a batch of several (a history the model
    broadcasts over its feature rows) goes whole with any of them."""
    n = _rows(inputs)
    return {name: a if n > 1 and len(a) == 1 else a[rows] for name, a in inputs.items()}


class EnginePool:
    """Engines in preference order plus one fallback that accepts any shape."""

    def __init__(
        self,
        engines: Sequence[Engine],
        fallback: Engine,
        *,
        history_input: str | None = "history",
        mask_input: str | None = "history_mask",
        min_history_length: int = 1,
        max_consecutive_errors: int = 3,
        accepted_precisions: Collection[str] | None = None,
    ) -> None:
        self._engines = [
            e for e in engines if accepted_precisions is None or e.precision in accepted_precisions
        ]
        self.fallback = fallback
        self.history_input = history_input
        self.mask_input = mask_input
        self.min_history_length = min_history_length
        self.max_consecutive_errors = max_consecutive_errors
        self._lock = threading.Lock()
        self._consecutive = {e.name: 0 for e in self._engines}
        self._total = {e.name: 0 for e in self._engines}
        self._last_error = {e.name: "" for e in self._engines}
        self._removed: set[str] = set()
        # What `in_service` returns, rebuilt under the lock when an engine is taken out or the
        # order changes: every batch reads it, so reading it must not take the lock.
        self._in_service = tuple(self._engines)
        # A calibration row the fallback scores finitely; see `_fail_over`.
        self._probe: dict[str, np.ndarray] | None = None

    @classmethod
    def for_manifest(
        cls, manifest: Manifest, engines: Sequence[Engine], fallback: Engine, **kwargs: object
    ) -> EnginePool:
        hist = manifest.history
        return cls(
            engines,
            fallback,
            history_input=hist.input if hist else None,
            mask_input=hist.mask_input if hist else None,
            min_history_length=hist.min_padded_length if hist else 1,
            **kwargs,  # type: ignore[arg-type]
        )

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every engine of the pool in the order tried, those out of service too (see `health`)."""
        with self._lock:
            return tuple(self._engines)

    @property
    def in_service(self) -> tuple[Engine, ...]:
        """The engines still tried, in order: those not taken out after errors or a hang."""
        return self._in_service

    @property
    def health(self) -> dict[str, EngineHealth]:
        with self._lock:
            return {
                e.name: EngineHealth(
                    e.name,
                    e.name not in self._removed,
                    self._consecutive[e.name],
                    self._total[e.name],
                    self._last_error[e.name],
                )
                for e in self._engines
            }

    def _serving(self) -> tuple[Engine, ...]:
        return tuple(e for e in self._engines if e.name not in self._removed)

    def _record(self, engine: Engine, error: EngineFailure | None = None) -> None:
        name = engine.name
        if name not in self._consecutive:  # the bare fallback keeps no record
            return
        with self._lock:
            if error is None:
                self._consecutive[name] = 0
                return
            self._consecutive[name] += 1
            self._total[name] += 1
            self._last_error[name] = str(error)
            hung = isinstance(error, EngineHung)
            if hung or self._consecutive[name] >= self.max_consecutive_errors:
                self._removed.add(name)
                self._in_service = self._serving()

    def _checked(self, engine: Engine, inputs: Arrays) -> dict[str, np.ndarray]:
        outputs = self._run_chunked(engine, inputs)
        if engine is not self.fallback and (name := _non_finite(outputs)) is not None:
            raise NonFiniteOutput(f"{engine.name}: non-finite values in output {name!r}")
        return outputs

    # -- running ---------------------------------------------------------------------------

    def run(self, inputs: Arrays) -> PoolResult:
        engines = self.in_service
        n = _rows(inputs)
        if not engines:
            reason = "engines_unavailable" if self._engines else ""
            return self._on_fallback(inputs, reason, n)
        shapes = _shapes(inputs)
        first_mismatch: ShapeMismatch | None = None
        for engine in engines:
            if engine is self.fallback and first_mismatch is not None:
                # Ranked among the engines, the fallback takes what an engine before it did
                # not fit as the fallback: rows split off where they can be, with the reason.
                break
            try:
                engine.select_profile(_without_batch_limit(engine, shapes))
            except ShapeMismatch as exc:
                first_mismatch = first_mismatch or exc
                continue
            return self._run_whole(engine, inputs)
        assert first_mismatch is not None
        split = self._split_by_history(engines, inputs)
        if split is not None:
            return split
        return self._on_fallback(inputs, _mismatch_reason(first_mismatch), n)

    def _on_fallback(self, inputs: Arrays, reason: str, n: int) -> PoolResult:
        # In chunks its batch range takes: a model exported with a fixed batch of 1 serves a
        # batch of several rows (an explained request's block, a stream's messages) row by row.
        outputs = self._run_chunked(self.fallback, inputs)
        return PoolResult(outputs, self.fallback.name, reason, (self.fallback.name,) * n)

    def _run_chunked(self, engine: Engine, inputs: Arrays) -> dict[str, np.ndarray]:
        limit = engine.max_batch_size
        n = _rows(inputs)
        if limit is None or n <= limit:
            return engine.infer(inputs)
        parts = [engine.infer(_take(inputs, slice(s, s + limit))) for s in range(0, n, limit)]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def _run_whole(self, engine: Engine, inputs: Arrays) -> PoolResult:
        n = _rows(inputs)
        try:
            outputs = self._checked(engine, inputs)
        except ShapeMismatch as exc:
            return self._on_fallback(inputs, _mismatch_reason(exc), n)
        except EngineFailure as exc:
            return self._fail_over(engine, exc, inputs, n)
        self._record(engine)
        return PoolResult(outputs, engine.name, "", (engine.name,) * n)

    def _fail_over(self, engine: Engine, exc: EngineFailure, inputs: Arrays, n: int) -> PoolResult:
        """Serve a batch `engine` failed on from the fallback, and count the failure.

        Non-finite output is not counted against an engine that still scores the probe (a row
        of the calibration sample) finitely: the batch's rows were outside its numeric range,
        as when FP16 overflows on values FP32 takes. Checked inputs can be extreme and still
        finite, and three such requests must not take an engine out of service.
        """
        if isinstance(exc, NonFiniteOutput) and self._probe is not None:
            try:
                self._checked(engine, self._probe)
            except EngineFailure as probe_exc:  # broken, or hung: counted as what it is
                exc = probe_exc
            except ShapeMismatch:
                pass  # the probe does not fit this engine: no evidence either way
            else:
                return self._on_fallback(inputs, f"non_finite_output: {engine.name}", n)
        self._record(engine, exc)
        return self._on_fallback(inputs, _error_reason(engine, exc), n)

    def _row_lengths(self, inputs: Arrays) -> np.ndarray | None:
        if self.mask_input is None or self.mask_input not in inputs:
            return None
        mask = np.asarray(inputs[self.mask_input]) > 0
        # A row's length is one past its last valid position (masks may have holes).
        last = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)
        # One history for several feature rows is every row's history.
        return np.broadcast_to(np.where(mask.any(axis=1), last, 0), (_rows(inputs),))

    def _split_by_history(self, engines: Sequence[Engine], inputs: Arrays) -> PoolResult | None:
        lengths = self._row_lengths(inputs)
        if lengths is None or self.history_input not in inputs:
            return None
        for engine in engines:
            cap = _history_cap(engine, self.history_input)
            if cap is None:
                continue
            low, high = cap
            fits = lengths <= high
            if not fits.any():
                continue
            rows = np.flatnonzero(fits)
            length = max(int(lengths[rows].max()), low, self.min_history_length)
            part = self._trim(_take(inputs, rows), min(length, high))
            try:
                engine.select_profile(_without_batch_limit(engine, _shapes(part)))
            except ShapeMismatch:
                continue
            return self._assemble(engine, inputs, part, rows, lengths, high)
        return None

    def _trim(self, part: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
        out = dict(part)
        for name in (self.history_input, self.mask_input):
            if name is None or name not in out:
                continue
            arr = out[name]
            if arr.shape[1] >= length:
                out[name] = np.ascontiguousarray(arr[:, :length])
            else:
                pad = [(0, 0), (0, length - arr.shape[1])] + [(0, 0)] * (arr.ndim - 2)
                out[name] = np.pad(arr, pad)
        return out

    def _assemble(
        self,
        engine: Engine,
        inputs: Arrays,
        part: Arrays,
        rows: np.ndarray,
        lengths: np.ndarray,
        high: int,
    ) -> PoolResult:
        n = _rows(inputs)
        rest = np.setdiff1d(np.arange(n), rows)
        try:
            fast = self._checked(engine, part)
        except ShapeMismatch as exc:
            return self._on_fallback(inputs, _mismatch_reason(exc), n)
        except EngineFailure as exc:
            return self._fail_over(engine, exc, inputs, n)
        self._record(engine)
        if rest.size == 0:
            # Only padding made the batch too long; every row fitted once trimmed.
            return PoolResult(fast, engine.name, "", (engine.name,) * n)
        longest = int(lengths[rest].max())
        reason = f"shape_mismatch: {self.history_input} length {longest} outside 1..{high}"
        slow = self._run_chunked(self.fallback, _take(inputs, rest))
        outputs = {}
        for name, value in fast.items():
            if name not in slow:  # an output only the engine returns (the fallback runs one)
                continue
            merged = np.empty((n, *value.shape[1:]), dtype=value.dtype)
            merged[rows] = value
            merged[rest] = slow[name]
            outputs[name] = merged
        names = np.full(n, self.fallback.name, dtype=object)
        names[rows] = engine.name
        return PoolResult(outputs, engine.name, reason, tuple(str(x) for x in names))

    # -- calibration -----------------------------------------------------------------------

    def calibrate(
        self, sample_inputs: Arrays, batch_sizes: Sequence[int], repeats: int = 15
    ) -> CalibrationReport:
        """Time every engine per batch size and order the pool fastest first.

        At each batch size the engines run in turn, `repeats` rounds, and each keeps its
        fastest run: the least disturbed by other work on the machine, and alike for every
        engine since a disturbance spans one round, not one engine's whole series. Engines are
        ranked by the geometric mean of their time relative to the fastest engine at each
        batch size they accept; a reduced-precision engine must be more than
        `REDUCED_PRECISION_MARGIN` faster than an FP32 one to be ranked above it (precision is
        given up only for speed that was measured); an engine that accepts no batch size keeps
        its place at the end. The sample's first row becomes the probe that tells a broken
        engine from rows outside its range (`_fail_over`), if the fallback scores it finitely.
        """
        probe = _take(sample_inputs, slice(0, 1))
        if _non_finite(self.fallback.infer(probe)) is None:
            self._probe = probe
        engines = list(self.in_service)
        seconds: dict[str, dict[int, float]] = {e.name: {} for e in engines}
        broken: set[str] = set()
        for size in batch_sizes:
            batch = _tile(sample_inputs, size)
            timed = [e for e in engines if e.name not in broken and _fits(e, batch)]
            best: dict[str, float] = {}
            for round_ in range(repeats + 1):  # the first round warms up: allocation, kernels
                for engine in timed:
                    if engine.name in broken:
                        continue
                    try:
                        start = time.perf_counter()
                        engine.infer(batch)
                        elapsed = time.perf_counter() - start
                    except EngineFailure as exc:
                        self._record(engine, exc)
                        broken.add(engine.name)
                        continue
                    if round_:
                        best[engine.name] = min(best.get(engine.name, elapsed), elapsed)
            for name, value in best.items():
                if name not in broken:
                    seconds[name][size] = value
        with self._lock:
            self._engines = rank_engines(self._engines, seconds)
            self._in_service = self._serving()
            order = tuple(e.name for e in self._engines)
        return CalibrationReport(seconds, order)


def rank_engines(
    engines: Sequence[Engine], seconds: Mapping[str, Mapping[int, float]]
) -> list[Engine]:
    """`engines` fastest first by `seconds` (engine name -> batch size -> seconds): the
    geometric mean of each engine's time relative to the fastest at each batch size it ran,
    times `REDUCED_PRECISION_MARGIN` for an engine below FP32; engines without a time last, in
    their order."""
    sizes = {size for times in seconds.values() for size in times}
    fastest = {size: min(t[size] for t in seconds.values() if size in t) for size in sizes}

    def score(engine: Engine) -> float:
        times = seconds.get(engine.name, {})
        ratios = [t / fastest[s] for s, t in times.items() if fastest[s] > 0]
        if not ratios:
            return float("inf")
        relative = float(np.exp(np.mean(np.log(ratios))))
        return relative * (REDUCED_PRECISION_MARGIN if engine.precision != "fp32" else 1.0)

    return sorted(engines, key=score)


def _fits(engine: Engine, batch: Arrays) -> bool:
    try:
        engine.select_profile(_shapes(batch))
    except ShapeMismatch:
        return False
    return True


def _tile(inputs: Arrays, rows: int) -> dict[str, np.ndarray]:
    have = _rows(inputs)
    index = np.arange(rows) % have
    return {name: np.ascontiguousarray(a[index]) for name, a in inputs.items()}


def _without_batch_limit(engine: Engine, shapes: dict[str, tuple[int, ...]]) -> dict:
    # Batches larger than a profile are chunked, so only the non-batch dims decide the fit.
    limit = engine.max_batch_size
    if limit is None:
        return shapes
    return {n: (min(s[0], limit), *s[1:]) if s else s for n, s in shapes.items()}


def _history_cap(engine: Engine, history_input: str | None) -> tuple[int, int] | None:
    """(min, max) history length over the engine's profiles, None if unbounded or absent."""
    caps = []
    for profile in engine.profiles:
        for spec in _specs(profile, history_input):
            if len(spec.dims) > 1 and spec.dims[1].max_value is not None:
                caps.append((spec.dims[1].min_value, spec.dims[1].max_value))
    return max(caps, key=lambda c: c[1]) if caps else None


def _specs(profile: Profile, name: str | None) -> list:
    return [s for s in profile.inputs if s.name == name]


def _error_reason(engine: Engine, exc: EngineFailure) -> str:
    kind = "engine_hung" if isinstance(exc, EngineHung) else "engine_error"
    return f"{kind}: {engine.name}"


def _mismatch_reason(exc: ShapeMismatch) -> str:
    return f"shape_mismatch: {exc.tensor} dims {list(exc.dims)} outside {exc.accepted}"
