"""Streams across a server's life: SIGTERM answers every message the server read before the
stream closes, and the client reconnects when a server goes away."""

from __future__ import annotations

import asyncio
import queue
import signal
import socket
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from fakes import fake_factory
from liveserver import LiveServer, server_process
from modelkit import write_sequence_model
from waiting import wait_until

from riskclient import RiskClient, ScoringError
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.api.stream import MessageStreams, StreamMethod
from service.batching.budget import Budget

MESSAGES = 200


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-lifecycle")
    write_sequence_model(root)
    return root


def request(i: int) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=f"m{i}",
        features={f"x{j}": 0.1 * j for j in range(4)},
        history=[pb.HistoryRow(values=[0.5, 1.0, -1.0])] * 3,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_answers_every_message_read_before_the_stream_closes(models):
    env = {
        "RISKSERVE_DEFAULT_MODEL": "seq-mini",
        "RISKSERVE_SHUTDOWN_GRACE_S": "10",
        "RISKSERVE_BUDGET_MS": "8000",
        "RISKSERVE_MAX_BATCH_SIZE": "64",
        "RISKSERVE_MAX_QUEUE_DELAY_US": "20000",
    }
    keep_open = threading.Event()

    marker = request(MESSAGES)
    marker.model = "no-such-model"

    def messages():
        yield from (request(i) for i in range(MESSAGES))
        # Refused at once: its answer shows the server has read every message before it.
        yield marker
        keep_open.wait(30)  # the client never half-closes: the server ends the stream

    replies: list[pb.ScoreResponse] = []
    with server_process(models, **env) as (proc, target), grpc.insecure_channel(target) as channel:
        call = pb_grpc.RiskScoringStub(channel).ScoreStream(messages(), timeout=60)
        received: queue.Queue = queue.Queue()

        def read() -> None:
            try:
                for reply in call:
                    received.put(reply)
            except grpc.RpcError:
                pass
            received.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while (reply := received.get(timeout=30)).request_id != marker.request_id:
            replies.append(reply)
        proc.send_signal(signal.SIGTERM)
        while (reply := received.get(timeout=30)) is not None:
            replies.append(reply)
        code, details = call.code(), call.details()
        keep_open.set()
        assert proc.wait(timeout=20) == 0
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in details
    # Every message was read before SIGTERM, so each one has its answer: scored, none
    # refused or lost, none twice.
    assert [r.status.code for r in replies] == [0] * MESSAGES
    assert sorted(r.request_id for r in replies) == sorted(f"m{i}" for i in range(MESSAGES))


def _serve(models, port: int, *, hold: bool = False):
    """`hold`: a lone request waits long for company, so it is in flight when the server dies."""
    env = {
        "RISKSERVE_DEFAULT_MODEL": "seq-mini",
        "RISKSERVE_PORT": str(port),
        "RISKSERVE_BUDGET_MS": "20000",
        "RISKSERVE_MAX_BATCH_SIZE": "64",
    }
    if hold:
        env["RISKSERVE_MAX_QUEUE_DELAY_US"] = "10000000"
    return server_process(models, **env)


@pytest.mark.parametrize("resend", [False, True])
def test_the_stream_client_reconnects_when_the_server_goes_away(models, resend):
    port = free_port()
    with (
        RiskClient(f"127.0.0.1:{port}") as client,
        client.stream(resend_unanswered=resend) as stream,
    ):
        with ThreadPoolExecutor(3) as pool:
            with _serve(models, port, hold=True) as (first, _):
                calls = [pool.submit(stream.score, request(i)) for i in range(3)]
                wait_until(lambda: stream.sent_unanswered == 3)
                first.kill()  # no drain: what it read is lost with it
                first.wait(timeout=10)
                if not resend:
                    for call in calls:
                        with pytest.raises(ScoringError) as err:
                            call.result(timeout=30)
                        assert err.value.code == grpc.StatusCode.UNAVAILABLE
            with _serve(models, port):
                if resend:
                    replies = [call.result(timeout=60) for call in calls]
                    assert [r.request_id for r in replies] == ["m0", "m1", "m2"]
                    assert all(r.status.code == 0 for r in replies)
                again = pool.submit(stream.score, request(9)).result(timeout=60)
                assert again.request_id == "m9" and again.status.code == 0
        assert stream.reconnects >= 1


def test_a_draining_stream_stops_reading_and_answers_what_it_holds(models):
    hang = threading.Event()
    factory, made = fake_factory()
    server = LiveServer(
        engine_factory=factory,
        models_dir=models,
        default_model="seq-mini",
        budget_ms=20000,
        shutdown_grace_s=20,
        warmup_iterations=0,
    )
    marker = request(99)
    marker.model = "no-such-model"
    with server:
        made["seq-mini"].hang = hang  # from now on: the load's probe of the output layout ran
        channel = grpc.insecure_channel(server.target)
        sent: queue.Queue = queue.Queue()
        call = pb_grpc.RiskScoringStub(channel).ScoreStream(iter(sent.get, None), timeout=60)
        for i in range(20):
            sent.put(request(i))
        sent.put(marker)
        replies = iter(call)
        assert next(replies).request_id == marker.request_id  # the 20 are read and held
        stopping = asyncio.run_coroutine_threadsafe(server.server.stop(), server._loop)
        wait_until(lambda: server.server.streams.draining)
        sent.put(request(50))  # sent after the drain began: not read, so not answered
        hang.set()
        held = []
        with pytest.raises(grpc.RpcError) as ended:
            for reply in replies:
                held.append(reply)
        stopping.result(timeout=30)
        sent.put(None)
        channel.close()
        server.server = None  # stopped above
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sorted(r.request_id for r in held) == sorted(f"m{i}" for i in range(20))
    assert all(r.status.code == 0 for r in held)


def test_a_stream_drained_before_its_reader_starts_ends_unavailable():
    """A drain (SIGTERM) that comes between a stream's start and its reader's first step ends
    the stream with UNAVAILABLE at once. Such an order cannot be forced on a real server, so
    the call's context here is a stand-in that asks for the drain as its headers go out."""
    streams = MessageStreams(4, Budget(5.0))

    class Context:
        code: grpc.StatusCode | None = None

        def invocation_metadata(self) -> tuple:
            return ()

        def time_remaining(self) -> None:
            return None

        async def send_initial_metadata(self, _metadata: tuple) -> None:
            asyncio.get_running_loop().call_soon(streams.drain)

        async def write(self, _message: object) -> None:
            raise AssertionError("nothing was read, so nothing is written")

        def set_code(self, code: grpc.StatusCode) -> None:
            self.code = code

        def set_details(self, _details: str) -> None:
            pass

    async def never() -> AsyncIterator[None]:
        await asyncio.Event().wait()
        yield None

    async def per_message(*_args: object) -> None:
        return None

    method = StreamMethod(per_message, lambda *_args: None, lambda _request: None)
    context = Context()

    async def serve() -> None:
        await asyncio.wait_for(streams.serve(never(), context, object(), method), timeout=5)

    asyncio.run(serve())
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert streams.open_streams == 0
