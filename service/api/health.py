"""`grpc.health.v1.Health`: readiness by model, and Watch streams that end at a graceful shutdown.

`show_readiness` reports each model under its own name, SERVING where its serving version is
loaded and NOT_SERVING where not; the server ("" service) is SERVING only while every model is.
The API services' names stay SERVING until shutdown: they answer as long as the process does.
Shedding load changes none of these.

The stock asyncio servicer keeps every Watch stream open until the server cancels it, so a
single watching load balancer makes ``server.stop(grace)`` wait out the whole grace period even
when no request is left. Here, `enter_graceful_shutdown` sends NOT_SERVING to every watcher,
gives them a moment to write it, then ends the streams with OK.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health, health_pb2

__all__ = ["DrainingHealth"]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DrainingHealth(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._watches: set[asyncio.Task[None]] = set()
        self._closing = False
        self._models: set[str] = set()

    async def show_readiness(self, ready: Mapping[str, bool]) -> None:
        """Each model's name, and the server's, SERVING or NOT_SERVING as `ready` says (a
        registry readiness listener); a model no longer listed is NOT_SERVING."""
        for name in self._models - ready.keys():
            await self.set(name, NOT_SERVING)
        self._models = set(ready)
        for name, is_ready in ready.items():
            await self.set(name, SERVING if is_ready else NOT_SERVING)
        await self.set("", SERVING if all(ready.values()) else NOT_SERVING)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        if self._closing:
            await context.write(health_pb2.HealthCheckResponse(status=NOT_SERVING))
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
