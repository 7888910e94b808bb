"""bench.loadgen's open loop times each call from when it was due: a client that falls behind
(here its event loop blocked at the start) has its lag charged to the calls it sent late, so no
call's latency is less than its send lag (no coordinated omission)."""

from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import numpy as np

from bench.loadgen import _open_loop
from bench.oip import MODEL_INFER_METHOD


class _Empty(grpc.GenericRpcHandler):
    def service(self, details):  # type: ignore[no-untyped-def]
        if details.method == MODEL_INFER_METHOD:
            return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")
        return None


def test_a_client_that_falls_behind_is_charged_its_lag():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((_Empty(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    offsets = np.linspace(0.0, 0.1, 50).tolist()

    async def run():  # type: ignore[no-untyped-def]
        start_wall = time.time() + 0.5

        async def stall() -> None:
            await asyncio.sleep(max(0.0, start_wall - time.time()))
            time.sleep(0.2)  # the client's loop blocked: every call goes out late

        staller = asyncio.create_task(stall())
        share = await _open_loop(f"127.0.0.1:{port}", b"", offsets, start_wall, 5.0, 4096)
        await staller
        return share

    try:
        share = asyncio.run(run())
    finally:
        server.stop(0)
    assert share.error_codes == [] and len(share.latencies_s) == len(offsets)
    # Each call's latency runs from its schedule, past its send lag: the sorted latencies
    # dominate the sorted lags one for one.
    lags, latencies = sorted(share.send_lag_s), sorted(share.latencies_s)
    assert max(lags) > 0.1  # the stall made the sends late
    assert all(latency >= lag for latency, lag in zip(latencies, lags, strict=True))
