"""A request's time: its caller's gRPC deadline, else the configured budget, less one margin.

Every scoring path (unary, batch, OIP, each message of a stream) turns its time into the
batcher's deadline here, once, when the request arrives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["MARGIN", "Budget"]

# The one safety margin on a request's time: the share the batcher must not plan to fill. It
# covers what follows scoring (the hand-back to the event loop, the reply) and the engine-time
# model's error (its estimates are means; the tail of a queue is not). Without it, under
# overload the admitted requests' p99 sits at the budget itself, since the batcher admits what
# it expects to finish just in time.
MARGIN = 0.2


@dataclass(frozen=True, slots=True)
class Budget:
    """The time a request has, `seconds` where its caller set no deadline."""

    seconds: float

    @property
    def usable_s(self) -> float:
        """What the batcher may plan to fill of a request with the default budget."""
        return self.seconds * (1.0 - MARGIN)

    def deadline(self, remaining_s: float | None) -> float:
        """Monotonic time by which a request with `remaining_s` left (None: the caller set no
        deadline) must be scored."""
        remaining = self.seconds if remaining_s is None else max(remaining_s, 0.0)
        return time.monotonic() + remaining * (1.0 - MARGIN)
