"""Decision cut-offs chosen on validation scores, shared by the demo models' training scripts."""

from __future__ import annotations

import numpy as np

__all__ = ["thresholds"]


def thresholds(scores: np.ndarray, labels: np.ndarray, review_rate: float, precision: float):
    """Review at the score flagging ``review_rate`` of rows; decline where precision is reached.

    The decline cut-off is the lowest score at or above the review cut-off from which the
    share of fraud among rows scoring at least that much is >= ``precision`` (and stays so for
    every higher cut-off with at least 20 rows). Falls back to the 99.5th percentile.
    """
    review = float(np.quantile(scores, 1.0 - review_rate))
    order = np.argsort(-scores)
    s, y = scores[order], labels[order]
    prec = np.cumsum(y) / np.arange(1, len(y) + 1)
    ok = (prec >= precision) & (s >= review)
    ok[:20] = True  # too few rows above to judge
    bad = np.flatnonzero(~ok)
    first_bad = int(bad[0]) if len(bad) else len(s)
    decline = float(s[first_bad - 1]) if first_bad >= 20 else float(np.quantile(scores, 0.995))
    return round(review, 4), round(max(decline, review), 4)
