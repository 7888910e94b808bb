from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import pytest

from engines.base import DimRange, Engine, EngineFailure, Profile, TensorSpec
from engines.pool import REDUCED_PRECISION_MARGIN, EnginePool, rank_engines


def _score(inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """Row score that padding cannot change: zero history rows add nothing."""
    f = inputs["features"].sum(axis=1)
    h = (inputs["history"] * inputs["history_mask"][..., None]).sum(axis=(1, 2))
    return (f + h)[:, None].astype(np.float32)


class FakeEngine(Engine):
    """Declares TensorRT-style bounded profiles; the base class raises ShapeMismatch."""

    kind = "tensorrt"

    def __init__(
        self,
        name: str,
        *,
        max_batch: int | None = 8,
        max_length: int | None = 16,
        precision: str = "fp16",
        delay_s: float = 0.0,
        fail: int = 0,
        half_range: bool = False,
        nan: bool = False,
    ) -> None:
        self.name = name
        self.precision = precision
        self.delay_s = delay_s
        self.fail = fail
        self.half_range = half_range  # scores pass through float16, as in an FP16 engine
        self.nan = nan
        self.calls: list[dict[str, tuple[int, ...]]] = []
        batch = DimRange(1, 1, max_batch)
        length = DimRange(1, 1, max_length)
        self.profiles = (
            Profile(
                0,
                (
                    TensorSpec("features", "float32", (batch, DimRange(4, 4, 4))),
                    TensorSpec("history", "float32", (batch, length, DimRange(2, 2, 2))),
                    TensorSpec("history_mask", "float32", (batch, length)),
                ),
            ),
        )

    def _infer(self, inputs, profile):
        self.calls.append({n: a.shape for n, a in inputs.items()})
        if self.fail:
            self.fail -= 1
            raise EngineFailure(f"{self.name} failed")
        if self.delay_s:
            time.sleep(self.delay_s)
        score = _score(inputs)
        if self.half_range:
            with np.errstate(over="ignore"):
                score = score.astype(np.float16).astype(np.float32)
        if self.nan:
            score[:] = np.nan
        return {"score": score}


def _batch(lengths: list[int], padded: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(len(lengths) * 100 + padded)
    n = len(lengths)
    mask = (np.arange(padded)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
    return {
        "features": rng.normal(size=(n, 4)).astype(np.float32),
        "history": (rng.normal(size=(n, padded, 2)) * mask[..., None]).astype(np.float32),
        "history_mask": mask,
    }


def _pool(*engines: Engine, listed: bool = False, **kw) -> tuple[EnginePool, FakeEngine]:
    """A pool of `engines` and an ONNX Runtime-like fallback; `listed`: the fallback is ranked
    among the engines too, last, as the service's loader wires it."""
    fallback = FakeEngine("onnxruntime-cpu", max_batch=None, max_length=None, precision="fp32")
    fallback.kind = "onnxruntime"
    return EnginePool([*engines, *([fallback] if listed else [])], fallback, **kw), fallback


def test_fitting_batch_runs_on_the_first_engine() -> None:
    fast = FakeEngine("tensorrt-fp16")
    pool, fallback = _pool(fast)
    inputs = _batch([3, 5, 1], padded=5)
    result = pool.run(inputs)
    assert result.engine_name == "tensorrt-fp16"
    assert result.fallback_reason == ""
    assert result.row_engines == ("tensorrt-fp16",) * 3
    np.testing.assert_allclose(result.outputs["score"], _score(inputs))
    assert not fallback.calls


def test_too_long_history_goes_to_the_fallback_with_a_reason() -> None:
    pool, fallback = _pool(FakeEngine("tensorrt-fp16"))
    result = pool.run(_batch([80, 70, 20], padded=80))
    assert result.engine_name == "onnxruntime-cpu"
    assert result.fallback_reason == (
        "shape_mismatch: history dims [3, 80, 2] outside [1..8, 1..16, 2..2]"
    )
    assert len(fallback.calls) == 1


def test_mixed_batch_is_split_by_row_and_reassembled() -> None:
    fast = FakeEngine("tensorrt-fp16")
    pool, fallback = _pool(fast)
    lengths = [3, 40, 16, 1, 17, 9]
    inputs = _batch(lengths, padded=40)
    result = pool.run(inputs)
    np.testing.assert_allclose(result.outputs["score"], _score(inputs), rtol=1e-6)
    assert result.row_engines == (
        "tensorrt-fp16",
        "onnxruntime-cpu",
        "tensorrt-fp16",
        "tensorrt-fp16",
        "onnxruntime-cpu",
        "tensorrt-fp16",
    )
    assert result.engine_name == "tensorrt-fp16"
    assert result.fallback_reason == "shape_mismatch: history length 40 outside 1..16"
    # The engine saw only its rows, trimmed to their longest history.
    assert fast.calls == [{"features": (4, 4), "history": (4, 16, 2), "history_mask": (4, 16)}]
    assert fallback.calls[0]["features"] == (2, 4)


def test_a_fallback_ranked_among_the_engines_takes_what_they_do_not_fit_as_the_fallback():
    fast = FakeEngine("tensorrt-fp16")
    pool, _ = _pool(fast, listed=True)
    inputs = _batch([3, 40, 16], padded=40)
    result = pool.run(inputs)
    assert result.row_engines == ("tensorrt-fp16", "onnxruntime-cpu", "tensorrt-fp16")
    assert result.fallback_reason == "shape_mismatch: history length 40 outside 1..16"
    np.testing.assert_allclose(result.outputs["score"], _score(inputs), rtol=1e-6)
    whole = pool.run(_batch([80, 70], padded=80))  # no row fits: the fallback, with the reason
    assert whole.engine_name == "onnxruntime-cpu"
    assert whole.fallback_reason.startswith("shape_mismatch: history dims [2, 80, 2]")


class _WithLogit(FakeEngine):
    """An engine that returns every output of its graph, as TensorRT does: one more than the
    score the fallback is asked for."""

    def _infer(self, inputs, profile):
        outputs = super()._infer(inputs, profile)
        return {**outputs, "logit": outputs["score"] * 2}


def test_a_split_batch_joins_the_outputs_both_engines_returned():
    pool, _ = _pool(_WithLogit("tensorrt-fp16"))
    inputs = _batch([3, 40, 16], padded=40)
    result = pool.run(inputs)
    assert set(result.outputs) == {"score"}
    np.testing.assert_allclose(result.outputs["score"], _score(inputs), rtol=1e-6)


def test_padding_alone_does_not_cause_a_fallback() -> None:
    fast = FakeEngine("tensorrt-fp16")
    pool, fallback = _pool(fast)
    inputs = _batch([2, 5], padded=64)
    result = pool.run(inputs)
    assert result.fallback_reason == ""
    assert fast.calls[0]["history"] == (2, 5, 2)
    np.testing.assert_allclose(result.outputs["score"], _score(inputs), rtol=1e-6)
    assert not fallback.calls


def test_large_batch_is_chunked_to_the_profile() -> None:
    fast = FakeEngine("tensorrt-fp16", max_batch=8)
    pool, _ = _pool(fast)
    inputs = _batch([4] * 20, padded=4)
    result = pool.run(inputs)
    assert [c["features"][0] for c in fast.calls] == [8, 8, 4]
    np.testing.assert_allclose(result.outputs["score"], _score(inputs), rtol=1e-6)


def _against_one_history(rows: int, length: int) -> tuple[dict, dict]:
    """Feature rows against one history, and the same with the history repeated per row."""
    inputs = _batch([length], padded=length)
    features = np.random.default_rng(rows).normal(size=(rows, 4)).astype(np.float32)
    shared = {**inputs, "features": features}
    repeated = {
        "features": features,
        "history": np.repeat(inputs["history"], rows, axis=0),
        "history_mask": np.repeat(inputs["history_mask"], rows, axis=0),
    }
    return shared, repeated


def test_one_history_goes_whole_with_every_chunk() -> None:
    fast = FakeEngine("tensorrt-fp16", max_batch=8)
    pool, _ = _pool(fast)
    shared, repeated = _against_one_history(20, 4)
    result = pool.run(shared)
    assert [c["features"][0] for c in fast.calls] == [8, 8, 4]
    assert {c["history"] for c in fast.calls} == {(1, 4, 2)}
    np.testing.assert_allclose(result.outputs["score"], _score(repeated), rtol=1e-6)


def test_one_history_too_long_for_the_engine_sends_every_row_to_the_fallback() -> None:
    pool, fallback = _pool(FakeEngine("tensorrt-fp16"))
    shared, repeated = _against_one_history(5, 40)
    result = pool.run(shared)
    assert result.engine_name == "onnxruntime-cpu"
    assert result.row_engines == ("onnxruntime-cpu",) * 5
    assert fallback.calls == [{"features": (5, 4), "history": (1, 40, 2), "history_mask": (1, 40)}]
    np.testing.assert_allclose(result.outputs["score"], _score(repeated), rtol=1e-6)


def test_engine_error_falls_back_and_repeated_errors_remove_the_engine() -> None:
    fast = FakeEngine("tensorrt-fp16", fail=3)
    pool, _fallback = _pool(fast, max_consecutive_errors=3)
    inputs = _batch([2, 3], padded=3)
    for _ in range(3):
        result = pool.run(inputs)
        assert result.engine_name == "onnxruntime-cpu"
        assert result.fallback_reason == "engine_error: tensorrt-fp16"
        np.testing.assert_allclose(result.outputs["score"], _score(inputs))
    health = pool.health["tensorrt-fp16"]
    assert not health.healthy and health.total_errors == 3
    assert pool.in_service == ()
    assert [e.name for e in pool.engines] == ["tensorrt-fp16"]  # still listed, as unhealthy
    result = pool.run(inputs)
    assert result.fallback_reason == "engines_unavailable"
    assert len(fast.calls) == 3


def test_a_success_resets_the_error_count() -> None:
    fast = FakeEngine("tensorrt-fp16", fail=2)
    pool, _ = _pool(fast, max_consecutive_errors=3)
    inputs = _batch([2], padded=2)
    pool.run(inputs)
    pool.run(inputs)
    assert pool.health["tensorrt-fp16"].consecutive_errors == 2
    assert pool.run(inputs).engine_name == "tensorrt-fp16"
    assert pool.health["tensorrt-fp16"].consecutive_errors == 0
    assert pool.health["tensorrt-fp16"].healthy


def _extreme(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Finite features beyond float16's range (65504)."""
    return {**inputs, "features": np.full_like(inputs["features"], 1e6)}


def test_rows_outside_an_engines_range_do_not_take_it_out_of_service() -> None:
    fp16 = FakeEngine("tensorrt-fp16", half_range=True)
    pool, _ = _pool(fp16, max_consecutive_errors=3)
    ordinary = _batch([2, 3], padded=3)
    pool.calibrate(ordinary, [1])
    for _ in range(5):  # more than max_consecutive_errors
        result = pool.run(_extreme(ordinary))
        assert result.engine_name == "onnxruntime-cpu"
        assert result.fallback_reason == "non_finite_output: tensorrt-fp16"
        np.testing.assert_allclose(result.outputs["score"], _score(_extreme(ordinary)))
    health = pool.health["tensorrt-fp16"]
    assert health.healthy and health.consecutive_errors == 0 and health.total_errors == 0
    assert pool.run(ordinary).engine_name == "tensorrt-fp16"


@pytest.mark.parametrize("calibrated", [True, False])
def test_an_engine_that_returns_nan_for_every_row_leaves_the_pool(calibrated: bool) -> None:
    """Its probe row comes back non-finite too; without a probe every non-finite batch counts."""
    broken = FakeEngine("tensorrt-fp16", nan=True)
    pool, _ = _pool(broken, max_consecutive_errors=3)
    inputs = _batch([2], padded=2)
    if calibrated:
        pool.calibrate(inputs, [1])
    for _ in range(3):
        result = pool.run(inputs)
        assert result.fallback_reason == "engine_error: tensorrt-fp16"
        np.testing.assert_allclose(result.outputs["score"], _score(inputs))
    assert not pool.health["tensorrt-fp16"].healthy
    assert pool.run(inputs).fallback_reason == "engines_unavailable"


def test_second_engine_takes_what_the_first_cannot() -> None:
    short = FakeEngine("tensorrt-int8", max_length=8, precision="int8")
    long = FakeEngine("tensorrt-fp16", max_length=64)
    pool, fallback = _pool(short, long)
    result = pool.run(_batch([30, 2], padded=30))
    assert result.engine_name == "tensorrt-fp16"
    assert not short.calls and not fallback.calls


def test_without_accelerated_engines_the_fallback_is_primary() -> None:
    pool, _fallback = _pool()
    result = pool.run(_batch([2], padded=2))
    assert (result.engine_name, result.fallback_reason) == ("onnxruntime-cpu", "")


def test_only_accepted_precisions_join_the_pool() -> None:
    pool, _ = _pool(
        FakeEngine("tensorrt-int8", precision="int8"),
        FakeEngine("tensorrt-fp16"),
        accepted_precisions={"fp32", "fp16"},
    )
    assert [e.name for e in pool.engines] == ["tensorrt-fp16"]


def test_calibrate_orders_engines_fastest_first() -> None:
    slow = FakeEngine("tensorrt-fp16", delay_s=0.004)
    quick = FakeEngine("tensorrt-int8", delay_s=0.0, precision="int8")
    pool, _ = _pool(slow, quick)
    report = pool.calibrate(_batch([3, 2], padded=4), batch_sizes=[1, 8, 32], repeats=3)
    assert report.order == ("tensorrt-int8", "tensorrt-fp16")
    assert [e.name for e in pool.engines] == ["tensorrt-int8", "tensorrt-fp16"]
    assert set(report.seconds["tensorrt-fp16"]) == {1, 8}  # 32 rows exceed the profile
    assert report.seconds["tensorrt-fp16"][1] >= 0.004


@pytest.mark.parametrize("int8_ratio", [1.0, 0.97, 0.9])
def test_a_reduced_precision_engine_ranks_first_only_when_measurably_faster(int8_ratio) -> None:
    fp32 = FakeEngine("onnxruntime-cpu", precision="fp32")
    int8 = FakeEngine("onnxruntime-cpu-int8", precision="int8")
    idle = FakeEngine("onnxruntime-cpu-fp16", precision="fp16")  # accepted no batch size
    seconds = {
        "onnxruntime-cpu": {1: 0.001, 8: 0.004},
        "onnxruntime-cpu-int8": {1: 0.001 * int8_ratio, 8: 0.004 * int8_ratio},
    }
    ranked = [e.name for e in rank_engines([idle, int8, fp32], seconds)]
    faster = int8_ratio * REDUCED_PRECISION_MARGIN < 1.0
    first = "onnxruntime-cpu-int8" if faster else "onnxruntime-cpu"
    assert ranked[0] == first and ranked[-1] == "onnxruntime-cpu-fp16"


@pytest.mark.parametrize("lengths", [[0, 3], [0, 0]])
def test_rows_without_history_fit(lengths: list[int]) -> None:
    pool, _ = _pool(FakeEngine("tensorrt-fp16"))
    inputs = _batch(lengths, padded=20)
    result = pool.run(inputs)
    assert result.engine_name == "tensorrt-fp16"
    np.testing.assert_allclose(result.outputs["score"], _score(inputs), rtol=1e-6)
