"""The call lane (`service.api.http1`): unary gRPC calls over HTTP/1.1 on a worker's Unix socket,
as the front sends them, answered by a live server's own handlers; here spoken to byte by byte,
then through the front with a gRPC client."""

from __future__ import annotations

import gzip
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import grpc
import pytest
from liveserver import LiveServer, needs_haproxy, server_process
from modelkit import sequence_request, write_sequence_model
from waiting import wait_until

from bench.servers import free_port
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.api.http1 import MAX_HEADER_BYTES, MAX_PIPELINED, parse_timeout

SCORE = "/riskscoring.v1.RiskScoring/Score"
TOKEN = "lane-secret"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lane") / "models"
    write_sequence_model(root)
    return root


@pytest.fixture(scope="module")
def lane(models: Path) -> Iterator[tuple[Path, LiveServer]]:
    """A live server with its call lane on a Unix socket (a short path: the kernel's limit is
    108 bytes), a token required and a 4 KiB message limit."""
    folder = Path(tempfile.mkdtemp(prefix="lane-"))
    path = folder / "calls.sock"
    server = LiveServer(
        calls_path=path,
        models_dir=models,
        default_model="seq-mini",
        auth_token=TOKEN,
        max_message_bytes=4096,
    )
    with server:
        yield path, server
    shutil.rmtree(folder, ignore_errors=True)


class Answer:
    """One HTTP/1.1 answer: its status line, headers, gRPC message and trailers."""

    def __init__(self, raw: bytes) -> None:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = lines[0]
        self.headers = dict(_field(line) for line in lines[1:])
        self.message: bytes | None = None
        self.trailers: dict[str, str] = {}
        if self.headers.get("transfer-encoding") == "chunked":
            size, _, rest = rest.partition(b"\r\n")
            chunk = rest[: int(size, 16)]
            assert chunk[0] == 0 and int.from_bytes(chunk[1:5], "big") == len(chunk) - 5
            self.message = chunk[5:]
            tail = rest[int(size, 16) :].decode("latin-1")
            assert tail.startswith("\r\n0\r\n") and tail.endswith("\r\n\r\n"), tail
            self.trailers = dict(_field(line) for line in tail[5:-4].split("\r\n") if line)

    @property
    def grpc_status(self) -> int:
        return int(self.trailers.get("grpc-status", self.headers.get("grpc-status", "-1")))

    @property
    def grpc_message(self) -> str:
        return unquote(self.headers.get("grpc-message", self.trailers.get("grpc-message", "")))


def _field(line: str) -> tuple[str, str]:
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


def _complete(raw: bytes) -> bool:
    head, found, rest = raw.partition(b"\r\n\r\n")
    if not found:
        return False
    if b"transfer-encoding: chunked" in head.lower():
        return rest.endswith(b"\r\n\r\n") and b"\r\n0\r\n" in rest
    return True  # every other answer of the lane has no body


def _request(
    path: str,
    message: bytes,
    headers: dict[str, str] | None = None,
    flag: int = 0,
) -> bytes:
    """A request as HAProxy writes one: the gRPC message length-prefixed in a chunked body."""
    fields = {"content-type": "application/grpc", "te": "trailers",
              "authorization": f"Bearer {TOKEN}", **(headers or {})}  # fmt: skip
    head = f"POST {path} HTTP/1.1\r\nhost: lane\r\ntransfer-encoding: chunked\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in fields.items() if v is not None)
    return head.encode() + b"\r\n" + _frame(message, flag) + b"0\r\n\r\n"


def _frame(message: bytes, flag: int = 0) -> bytes:
    """A gRPC message, length-prefixed, as one chunk of a chunked body."""
    body = bytes([flag]) + len(message).to_bytes(4, "big") + message
    return b"%x\r\n" % len(body) + body + b"\r\n"


def _connect(path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        raise
    return conn


def _read(conn: socket.socket, answers: int = 1) -> list[Answer]:
    raw, found = b"", []
    while len(found) < answers:
        data = conn.recv(65536)
        if not data:
            break
        raw += data
        while _complete(raw):
            end = _answer_end(raw)
            found.append(Answer(raw[:end]))
            raw = raw[end:]
    return found


def _answer_end(raw: bytes) -> int:
    head_end = raw.index(b"\r\n\r\n") + 4
    if b"transfer-encoding: chunked" not in raw[:head_end].lower():
        return head_end
    return raw.index(b"\r\n\r\n", raw.index(b"\r\n0\r\n", head_end)) + 4


def _call(path: Path, request: bytes) -> Answer:
    with _connect(path) as conn:
        conn.sendall(request)
        (answer,) = _read(conn)
    return answer


def test_a_call_is_answered_as_on_the_grpc_port_with_its_status_in_trailers(lane):
    path, server = lane
    request = sequence_request(3, 10)
    answer = _call(path, _request(SCORE, request.SerializeToString()))
    assert answer.status == "HTTP/1.1 200 OK"
    assert answer.headers["content-type"] == "application/grpc"
    assert answer.trailers == {"grpc-status": "0"}
    assert answer.message is not None
    via_lane = pb.ScoreResponse.FromString(answer.message)
    with server.channel() as channel:
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        via_grpc = pb_grpc.RiskScoringStub(channel).Score(request, metadata=metadata)
    assert via_lane.request_id == "q3"
    assert via_lane.score == via_grpc.score and via_lane.decision == via_grpc.decision


def test_a_refused_call_carries_its_status_and_message_in_the_headers_naming_the_field(lane):
    path, _ = lane
    bad = pb.ScoreRequest(request_id="bad", features={"x0": 1.0, "nope": 2.0})
    answer = _call(path, _request(SCORE, bad.SerializeToString()))
    assert answer.headers["content-length"] == "0" and answer.message is None
    assert answer.grpc_status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "nope" in answer.grpc_message


def test_the_lane_applies_the_servers_authentication(lane):
    path, _ = lane
    message = sequence_request(1, 10).SerializeToString()
    for token in (None, "Bearer wrong"):
        answer = _call(path, _request(SCORE, message, {"authorization": token}))  # type: ignore[dict-item]
        assert answer.grpc_status == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert answer.message is None


def test_grpc_timeout_is_the_calls_deadline(lane):
    path, _ = lane
    assert parse_timeout(b"250m") == 0.25 and parse_timeout(b"3S") == 3.0
    assert parse_timeout(b"12x") is None and parse_timeout(b"m") is None
    message = sequence_request(1, 10).SerializeToString()
    answer = _call(path, _request(SCORE, message, {"grpc-timeout": "1n"}))
    assert answer.grpc_status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    answer = _call(path, _request(SCORE, message, {"grpc-timeout": "5S"}))
    assert answer.grpc_status == 0


def test_unknown_methods_are_unimplemented(lane):
    path, _ = lane
    message = sequence_request(1, 10).SerializeToString()
    for method in ("/riskscoring.v1.RiskScoring/Nope", "/grpc.health.v1.Health/Watch"):
        answer = _call(path, _request(method, message))
        assert answer.grpc_status == grpc.StatusCode.UNIMPLEMENTED.value[0], method


def test_a_message_beyond_the_limit_is_refused_and_the_lane_goes_on(lane):
    path, _ = lane
    big = pb.ScoreRequest(request_id="big", features={f"f{i}": 1.0 for i in range(600)})
    assert len(big.SerializeToString()) > 4096
    answer = _call(path, _request(SCORE, big.SerializeToString()))
    assert answer.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "larger than max" in answer.grpc_message
    answer = _call(path, _request(SCORE, sequence_request(1, 10).SerializeToString()))
    assert answer.grpc_status == 0


def test_compressed_messages_inflate_with_gzip_and_others_are_unimplemented(lane):
    path, _ = lane
    message = sequence_request(2, 10).SerializeToString()
    packed = gzip.compress(message)
    answer = _call(path, _request(SCORE, packed, {"grpc-encoding": "gzip"}, flag=1))
    assert answer.grpc_status == 0 and answer.message is not None
    assert pb.ScoreResponse.FromString(answer.message).request_id == "q2"
    answer = _call(path, _request(SCORE, packed, {"grpc-encoding": "br"}, flag=1))
    assert answer.grpc_status == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert "grpc-encoding br" in answer.grpc_message
    bomb = gzip.compress(bytes(10 * 1024 * 1024))  # 10 MiB of zeros in about 10 KiB
    answer = _call(path, _request(SCORE, bomb[:4000], {"grpc-encoding": "gzip"}, flag=1))
    assert answer.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def test_a_body_that_is_not_one_message_is_refused(lane):
    path, _ = lane
    request = _request(SCORE, sequence_request(1, 10).SerializeToString())
    # The length prefix says one byte more than the body holds.
    head, _, rest = request.partition(b"\r\n\r\n")
    size, _, body = rest.partition(b"\r\n")
    broken = body[:1] + (int.from_bytes(body[1:5], "big") + 1).to_bytes(4, "big") + body[5:]
    answer = _call(path, head + b"\r\n\r\n" + size + b"\r\n" + broken)
    assert answer.grpc_status == grpc.StatusCode.INTERNAL.value[0]
    garbage = _call(path, _request(SCORE, b"\xff\xff\xff"))
    assert garbage.grpc_status == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_calls_on_one_connection_are_answered_in_order_even_sent_together(lane):
    path, _ = lane
    requests = [_request(SCORE, sequence_request(i, 10).SerializeToString()) for i in range(5)]
    with _connect(path) as conn:
        conn.sendall(requests[0])
        (first,) = _read(conn)
        conn.sendall(b"".join(requests[1:]))  # pipelined: HAProxy never does, a client might
        rest = _read(conn, 4)
    ids = [pb.ScoreResponse.FromString(a.message or b"").request_id for a in [first, *rest]]
    assert ids == [f"q{i}" for i in range(5)]


def test_calls_queued_beyond_the_bound_or_a_huge_path_end_the_connection(lane):
    path, _ = lane
    request = _request(SCORE, sequence_request(1, 10).SerializeToString())
    with _connect(path) as conn:
        conn.sendall(request * (MAX_PIPELINED + 3))  # one in flight, more queued than allowed
        raw = b""
        while data := conn.recv(65536):
            raw += data
    assert raw.count(b"grpc-status: 0") <= MAX_PIPELINED + 1
    assert raw.endswith(
        b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )
    huge = _request("/" + "x" * (2 * MAX_HEADER_BYTES), b"")
    with _connect(path) as conn:
        conn.sendall(huge)
        (answer,) = _read(conn)
    assert answer.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def test_bad_http_gets_400_and_a_caller_gone_mid_call_leaves_the_lane_serving(lane):
    path, server = lane
    with _connect(path) as conn:
        conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 400")
        assert conn.recv(4096) == b""  # closed
    with _connect(path) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nhost: lane\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 400")
    for i in range(20):  # sent, then gone before the answer
        with _connect(path) as conn:
            conn.sendall(_request(SCORE, sequence_request(i, 10).SerializeToString()))
    # Until the lane has read that those callers left, their calls count as in progress (and
    # may fill the admission limit): it answers again once each has ended.
    request = _request(SCORE, sequence_request(7, 10).SerializeToString())
    wait_until(lambda: _call(path, request).grpc_status == 0)
    assert server.server is not None
    admission = server.server.oip.admission  # type: ignore[attr-defined]
    wait_until(lambda: admission.active == 0)  # none left holding a place


def test_a_stopped_server_closes_its_lane(models: Path):
    folder = Path(tempfile.mkdtemp(prefix="lane-"))
    path = folder / "calls.sock"
    try:
        server = LiveServer(calls_path=path, models_dir=models, default_model="seq-mini")
        with server:
            conn = _connect(path)  # an idle connection, as HAProxy keeps
            answer = _call(path, _request(SCORE, sequence_request(1, 10).SerializeToString()))
            assert answer.grpc_status == 0
        assert conn.recv(4096) == b""  # closed by the stop
        conn.close()
        with pytest.raises(OSError), _connect(path):
            pass
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@needs_haproxy
def test_through_the_front_a_grpc_client_gets_answers_and_statuses(models: Path):
    with (
        server_process(
            models,
            output=[],
            RISKSERVE_FRONT="haproxy",
            RISKSERVE_PORT=str(free_port()),
            RISKSERVE_METRICS_PORT="none",
            RISKSERVE_DEFAULT_MODEL="seq-mini",
            RISKSERVE_AUTH_TOKEN=TOKEN,
        ) as (_, target),
        grpc.insecure_channel(target) as channel,
    ):
        stub = pb_grpc.RiskScoringStub(channel)
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        reply = stub.Score(sequence_request(4, 10), metadata=metadata, timeout=10)
        assert reply.request_id == "q4"
        packed = stub.Score(
            sequence_request(4, 10), metadata=metadata, timeout=10,
            compression=grpc.Compression.Gzip,
        )  # fmt: skip
        assert packed.score == reply.score
        with pytest.raises(grpc.RpcError) as refused:
            stub.Score(sequence_request(4, 10), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        bad = pb.ScoreRequest(request_id="bad", features={"x0": 1.0, "größe": 2.0})
        with pytest.raises(grpc.RpcError) as invalid:
            stub.Score(bad, metadata=metadata, timeout=10)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "größe" in invalid.value.details()  # percent-encoded on the way, decoded here


SCORE_STREAM = "/riskscoring.v1.RiskScoring/ScoreStream"


def _stream_head(token: str | None = TOKEN) -> bytes:
    auth = f"authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {SCORE_STREAM} HTTP/1.1\r\nhost: lane\r\ntransfer-encoding: chunked\r\n"
        f"content-type: application/grpc\r\nte: trailers\r\n{auth}\r\n"
    ).encode()


class _Chunks:
    """A stream's response read as it comes: its head, then its messages one by one."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.raw = b""
        self.head = self._until(b"\r\n\r\n").decode("latin-1")

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.raw:
            data = self.conn.recv(65536)
            assert data, f"closed before {marker!r}: {self.raw!r}"
            self.raw += data
        taken, _, self.raw = self.raw.partition(marker)
        return taken

    def message(self) -> pb.ScoreResponse:
        size = int(self._until(b"\r\n"), 16)
        while len(self.raw) < size + 2:
            self.raw += self.conn.recv(65536)
        chunk, self.raw = self.raw[:size], self.raw[size + 2 :]
        return pb.ScoreResponse.FromString(chunk[5:])

    def trailers(self) -> dict[str, str]:
        assert self._until(b"\r\n") == b"0"
        text = self._until(b"\r\n\r\n").decode("latin-1")
        return dict(_field(line) for line in text.split("\r\n") if line)


def test_a_stream_answers_each_message_as_it_comes_then_its_status(lane):
    path, _ = lane
    with _connect(path) as conn:
        conn.sendall(_stream_head())
        chunks = None
        for i in range(3):  # one at a time: each answer comes before the next is sent
            conn.sendall(_frame(sequence_request(i, 10).SerializeToString()))
            chunks = chunks or _Chunks(conn)
            assert chunks.message().request_id == f"q{i}"
        assert chunks is not None and "transfer-encoding: chunked" in chunks.head
        conn.sendall(b"".join(_frame(sequence_request(i, 10).SerializeToString()) for i in (3, 4)))
        conn.sendall(b"0\r\n\r\n")  # the caller half-closes
        assert sorted(chunks.message().request_id for _ in range(2)) == ["q3", "q4"]
        assert chunks.trailers() == {"grpc-status": "0", "grpc-message": ""}


def test_a_stream_without_credentials_or_with_an_oversized_message_ends_with_its_status(lane):
    path, _ = lane
    refused = _call(path, _stream_head(None) + _frame(b"") + b"0\r\n\r\n")
    assert refused.grpc_status == grpc.StatusCode.UNAUTHENTICATED.value[0]
    with _connect(path) as conn:
        conn.sendall(_stream_head())
        conn.sendall(_frame(sequence_request(1, 10).SerializeToString()))
        chunks = _Chunks(conn)
        assert chunks.message().request_id == "q1"
        conn.sendall(_frame(bytes(5000)))  # beyond the 4 KiB limit
        trailers = chunks.trailers()
    assert trailers["grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    assert "larger than max" in unquote(trailers["grpc-message"])


def test_a_stream_whose_answers_are_not_read_stops_reading(models: Path):
    """A caller that sends without reading fills the socket's buffers, not the server."""
    folder = Path(tempfile.mkdtemp(prefix="lane-"))
    path = folder / "calls.sock"
    try:
        server = LiveServer(
            calls_path=path, models_dir=models, default_model="seq-mini", max_stream_in_flight=4
        )
        with server, _connect(path) as conn:
            conn.sendall(_stream_head(None))
            frame = _frame(sequence_request(1, 10).SerializeToString())
            conn.settimeout(2.0)
            sent = 0
            with pytest.raises(TimeoutError):
                while sent < 200_000:  # far beyond what the buffers hold
                    conn.sendall(frame)
                    sent += 1
            assert sent < 200_000
            conn.settimeout(30)
            chunks = _Chunks(conn)  # and it still answers what it read
            assert chunks.message().request_id == "q1"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_stop_ends_an_open_stream_unavailable_after_answering_what_it_read(models: Path):
    folder = Path(tempfile.mkdtemp(prefix="lane-"))
    path = folder / "calls.sock"
    try:
        server = LiveServer(calls_path=path, models_dir=models, default_model="seq-mini")
        server.__enter__()
        stopping = threading.Thread(target=server.stop)  # the stop under test, and the cleanup
        try:
            with _connect(path) as conn:
                conn.sendall(_stream_head(None))
                conn.sendall(_frame(sequence_request(1, 10).SerializeToString()))
                chunks = _Chunks(conn)
                assert chunks.message().request_id == "q1"
                stopping.start()
                trailers = chunks.trailers()
        finally:
            if not stopping.is_alive() and server.server is not None:
                stopping.start()
            stopping.join(timeout=60)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert trailers["grpc-status"] == str(grpc.StatusCode.UNAVAILABLE.value[0])
    assert "shutting down" in unquote(trailers["grpc-message"])


def test_a_caller_that_reads_no_answers_stops_being_read(lane):
    """Unary answers a caller leaves unread wait in the socket, not in the worker: once the
    transport's buffer is full the lane stops reading that connection and starting its calls."""
    path, server = lane
    assert server.server is not None and server.server.lane is not None
    connections = server.server.lane._connections
    before = set(connections)
    # An unknown method's answer repeats its path, percent-encoded: three bytes a '%'.
    request = _request("/" + "%" * 15_000, b"")
    with _connect(path) as conn:
        wait_until(lambda: len(set(connections) - before) == 1)
        (mine,) = set(connections) - before
        sent = 0
        while mine._reading:
            assert sent < 2_000, "the lane kept reading a caller that reads nothing"
            conn.sendall(request)
            sent += 1
            wait_until(lambda: not mine._reading or (mine.current is None and not mine._pending))
        assert mine._transport.get_write_buffer_size() < 4 * 1024 * 1024


def test_a_compressed_message_cut_short_or_with_more_after_it_is_refused(lane):
    path, _ = lane
    packed = gzip.compress(sequence_request(2, 10).SerializeToString())
    for broken in (packed[:-8], packed + b"more"):  # no checksum; bytes after the end
        answer = _call(path, _request(SCORE, broken, {"grpc-encoding": "gzip"}, flag=1))
        assert answer.grpc_status == grpc.StatusCode.INTERNAL.value[0]
        assert "does not inflate" in answer.grpc_message
    answer = _call(path, _request(SCORE, packed, {"grpc-encoding": "identity"}, flag=1))
    assert answer.grpc_status == grpc.StatusCode.INTERNAL.value[0]
