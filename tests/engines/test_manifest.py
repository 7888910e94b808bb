"""Manifest checks: declared feature ranges name real features and are ordered."""

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


@pytest.mark.parametrize(
    ("ranges", "message"),
    [({"d": [0, 1]}, "unknown features: d"), ({"a": [1, 0]}, "low 1.0 is above high 0.0")],
)
def test_bad_ranges_are_refused(ranges, message):
    with pytest.raises(ValidationError, match=message):
        manifest(feature_ranges=ranges)
