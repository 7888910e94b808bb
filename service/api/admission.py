"""How many scoring calls one process lets in at once; the rest are refused at once."""

from __future__ import annotations

from service.batching.budget import Budget
from service.telemetry import Telemetry

__all__ = ["REQUEST_COST_S", "SCORING_METHODS", "Admission", "admission_limit", "refuse"]

# The RPCs that queue for an engine, and so are bounded by `Admission`.
SCORING_METHODS = frozenset({"Score", "ScoreBatch", "ModelInfer"})


class Admission:
    """At most `limit` scoring RPCs inside the service at once; the rest are refused at once.

    A request the batcher has seen is shed by its deadline when the queue ahead is too long; a
    request the event loop has not reached yet waits where nothing can see it. Bounding the
    calls admitted keeps that unseen wait short: an overloaded loop spends a refusal's few
    microseconds on the excess instead of decoding, queueing and timing it out, so the calls
    admitted still run at the service's capacity and the callers' p99 stays inside the budget.
    The servicers share one (their `admission` attribute); one event loop updates it.
    """

    __slots__ = ("active", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0


def refuse(telemetry: Telemetry | None, admission: Admission) -> str:
    if telemetry is not None:
        telemetry.metrics.count_shed("", "concurrency")
    return f"{admission.active} requests in progress, limit {admission.limit}; retry later"


# Server CPU one scoring request costs at 16 callers on the two-core development machine: 0.4
# to 0.8 ms measured (bench.compare), of which the do-nothing gRPC server's share is about 0.3
# ms; the low end is taken. It sizes the admission limit: more calls in progress than one
# process finishes within the budget would only wait, where the callers' clocks run and the
# service's do not.
REQUEST_COST_S = 0.0004


def admission_limit(budget: Budget) -> int:
    """Scoring calls one process admits at once: what it finishes within the usable budget."""
    return max(4, int(budget.usable_s / REQUEST_COST_S))
