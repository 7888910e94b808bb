"""Budget: a request's deadline from its caller's time, else the configured budget, less MARGIN."""

from __future__ import annotations

import time

import pytest

from service.batching.budget import MARGIN, Budget


@pytest.mark.parametrize(
    ("remaining_s", "planned_s"),
    [(None, 0.010 * (1 - MARGIN)), (0.5, 0.5 * (1 - MARGIN)), (-1.0, 0.0)],
)
def test_the_deadline_keeps_one_margin_of_the_time_left(remaining_s, planned_s):
    budget = Budget(0.010)
    before = time.monotonic()
    deadline = budget.deadline(remaining_s)
    after = time.monotonic()
    assert before + planned_s <= deadline <= after + planned_s


def test_the_usable_budget_is_the_share_the_batcher_may_plan():
    assert Budget(0.010).usable_s == pytest.approx(0.010 * (1 - MARGIN))
