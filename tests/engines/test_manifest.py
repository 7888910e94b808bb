"""Manifest checks: declared feature ranges name real features and are ordered; thresholds are
finite, within [0, 1] and ordered. Each refusal names the entry."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from engines.manifest import Manifest


def manifest(**fields) -> Manifest:
    return Manifest.model_validate(
        {
            "name": "m",
            "version": "1",
            "features": ["a", "b", "c"],
            "thresholds": {"review": 0.5, "decline": 0.9},
            **fields,
        }
    )


def test_bounds_follow_feature_order_and_are_open_where_undeclared():
    declared = manifest(feature_ranges={"c": [0, 1], "a": [-2, 2]})
    bounds = declared.feature_bounds
    assert bounds is not None
    np.testing.assert_array_equal(bounds.low, [-2, -np.inf, 0])
    np.testing.assert_array_equal(bounds.high, [2, np.inf, 1])
    assert manifest().feature_bounds is None
    # Built bounds do not change what a manifest equals.
    assert declared == manifest(feature_ranges={"c": [0, 1], "a": [-2, 2]})
    assert declared != manifest(feature_ranges={"c": [0, 2], "a": [-2, 2]})


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ({"d": [0, 1]}, "unknown features: d"),
        ({"a": [1, 0]}, "feature_ranges['a']: low 1.0 is above high 0.0"),
        ({"b": [NAN, 1]}, "feature_ranges['b']: [nan, 1.0] holds a NaN"),
        ({"b": [0, NAN]}, "feature_ranges['b']: [0.0, nan] holds a NaN"),
        ({"c": [INF, INF]}, "feature_ranges['c']: [inf, inf] admits no value"),
        ({"c": [-INF, -INF]}, "feature_ranges['c']: [-inf, -inf] admits no value"),
    ],
)
def test_bad_ranges_are_refused(ranges, message):
    with pytest.raises(ValidationError) as caught:
        manifest(feature_ranges=ranges)
    assert message in str(caught.value)


def test_a_range_may_be_open_on_one_side():
    bounds = manifest(feature_ranges={"a": [0, INF], "b": [-INF, 5]}).feature_bounds
    assert bounds is not None
    np.testing.assert_array_equal(bounds.low, [0, -np.inf, -np.inf])
    np.testing.assert_array_equal(bounds.high, [np.inf, 5, np.inf])


@pytest.mark.parametrize(
    ("thresholds", "entry", "message"),
    [
        ({"review": NAN, "decline": 0.9}, "thresholds.review", "finite number"),
        ({"review": 0.5, "decline": NAN}, "thresholds.decline", "finite number"),
        ({"review": -INF, "decline": 0.9}, "thresholds.review", "finite number"),
        ({"review": 0.5, "decline": INF}, "thresholds.decline", "finite number"),
        ({"review": -0.1, "decline": 0.9}, "thresholds.review", "greater than or equal to 0"),
        ({"review": 0.5, "decline": 1.5}, "thresholds.decline", "less than or equal to 1"),
        (
            {"review": 0.9, "decline": 0.5},
            "thresholds",
            "thresholds.decline 0.5 is below thresholds.review 0.9",
        ),
    ],
)
def test_thresholds_that_cannot_decide_are_refused(thresholds, entry, message):
    with pytest.raises(ValidationError) as caught:
        manifest(thresholds=thresholds)
    (error,) = caught.value.errors()
    assert ".".join(str(part) for part in error["loc"]) == entry
    assert message in str(caught.value)


def test_thresholds_may_meet_and_touch_the_ends():
    assert manifest(thresholds={"review": 0.0, "decline": 0.0}).thresholds.decide(0.0) == "DECLINE"
    assert manifest(thresholds={"review": 1.0, "decline": 1.0}).thresholds.decide(0.99) == (
        "APPROVE"
    )


@pytest.mark.parametrize("value", [NAN, INF, -0.1])
def test_a_tolerance_that_would_pass_every_variant_is_refused(value):
    with pytest.raises(ValidationError) as caught:
        manifest(tolerance={"max_abs_error": value})
    (error,) = caught.value.errors()
    assert ".".join(str(part) for part in error["loc"]) == "tolerance.max_abs_error"


def test_a_feature_named_twice_is_refused():
    with pytest.raises(ValidationError) as caught:
        manifest(features=["a", "b", "a", "b"])
    (error,) = caught.value.errors()
    assert error["loc"] == ("features",)
    assert "'a' is named more than once" in str(caught.value)


def test_a_history_field_named_twice_is_refused():
    with pytest.raises(ValidationError) as caught:
        manifest(history={"fields": ["amount", "gap_s", "amount"], "max_length": 8})
    (error,) = caught.value.errors()
    assert ".".join(str(part) for part in error["loc"]) == "history.fields"
    assert "'amount' is named more than once" in str(caught.value)


@pytest.mark.parametrize(
    ("profile", "entry", "message"),
    [
        ({"batch": [1, 8, 0]}, "batch", "[1, 8, 0] is not 1 <= min <= opt <= max"),
        ({"batch": [8, 4, -2]}, "batch", "[8, 4, -2] is not 1 <= min <= opt <= max"),
        ({"batch": [0, 0, 0]}, "batch", "[0, 0, 0] is not 1 <= min <= opt <= max"),
        ({"batch": [2, 1, 8]}, "batch", "[2, 1, 8] is not 1 <= min <= opt <= max"),
        (
            {"batch": [1, 8, 64], "history_length": [4, 16, 8]},
            "history_length",
            "[4, 16, 8] is not 1 <= min <= opt <= max",
        ),
    ],
)
def test_a_profile_range_out_of_order_is_refused(profile, entry, message):
    with pytest.raises(ValidationError) as caught:
        manifest(profiles={"fp16": [{"batch": [1, 4, 16]}, profile]})
    (error,) = caught.value.errors()
    assert ".".join(str(part) for part in error["loc"]) == f"profiles.fp16.1.{entry}"
    assert message in str(caught.value)


def test_a_profile_range_may_be_one_size():
    (spec,) = manifest(profiles={"fp32": [{"batch": [1, 1, 1]}]}).profiles["fp32"]
    assert spec.batch == (1, 1, 1) and spec.history_length is None
