"""`grpc.health.v1.Health` whose Watch streams end once a graceful shutdown has been announced.

The stock asyncio servicer keeps every Watch stream open until the server cancels it, so a
single watching load balancer makes ``server.stop(grace)`` wait out the whole grace period even
when no request is left. Here, `enter_graceful_shutdown` sends NOT_SERVING to every watcher,
gives them a moment to write it, then ends the streams with OK.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc_health.v1 import health, health_pb2

__all__ = ["DrainingHealth"]


class DrainingHealth(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._watches: set[asyncio.Task[None]] = set()
        self._closing = False

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        if self._closing:
            await context.write(
                health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
            )
            return
        watch = asyncio.ensure_future(super().Watch(request, context))
        self._watches.add(watch)
        try:
            await watch
        except asyncio.CancelledError:
            if not watch.cancelled() or not self._closing:
                raise  # the caller went away, or the server is cancelling: not ours to hide
        finally:
            self._watches.discard(watch)

    async def enter_graceful_shutdown(self, notice_s: float = 0.1) -> None:
        """NOT_SERVING everywhere; after `notice_s` for the watchers to write it, end them."""
        await super().enter_graceful_shutdown()
        self._closing = True
        if not self._watches:
            return
        await asyncio.sleep(notice_s)
        for watch in list(self._watches):
            watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._watches, return_exceptions=True)
