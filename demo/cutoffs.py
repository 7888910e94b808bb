"""What the demo models' training scripts share: their common options, and the decision
cut-offs chosen on validation scores."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

__all__ = ["add_training_arguments", "thresholds"]


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The output folder, the generator's seed and sizes, and the cut-off rule's targets."""
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=50_000)
    parser.add_argument("--validation-size", type=int, default=40_000)
    parser.add_argument("--review-rate", type=float, default=0.05)
    parser.add_argument("--decline-precision", type=float, default=0.9)


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
