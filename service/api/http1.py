"""The call lane: a worker's unary calls and bidirectional streams from the front, over HTTP/1.1.

Behind the front, a unary call need not pay for gRPC's Python transport (about 0.2 ms of CPU a
call, more than the demo model's run): HAProxy speaks HTTP/2 to the caller and HTTP/1.1 to
this lane, one call a connection at a time, its connections kept open. The call keeps gRPC's
form: a POST to `/<service>/<method>` whose body is one length-prefixed message, and an answer
whose status travels in trailers (`grpc-status`, `grpc-message`), or, for a call that fails,
in the headers of an answer with no body, gRPC's trailers-only form, which HAProxy passes on as
one HEADERS frame (and counts by server, `service.front`). The parser is httptools (llhttp, the
C parser Node.js uses); what runs in Python a call is the servicer's own handler, behind the
same interceptors (authentication) and the same method handlers as on the gRPC port.

A bidirectional stream (ScoreStream, ModelStreamInfer) works the same way in both directions
at once: its messages arrive as the chunks of a request body that ends when the caller
half-closes, and its answers leave as the chunks of the response, its status in the trailers;
HAProxy forwards both as they come. The connection closes when the stream ends.

The lane listens on a Unix socket in the front's private folder and serves the front alone:
it takes no TLS, no server-streaming RPC (health's Watch stays on the gRPC port) and no
connection from a caller directly. A message is bounded by the server's message limit, a
call's headers by `MAX_HEADER_BYTES`; a stream stops reading while `STREAM_READ_AHEAD`
messages wait for its handler, and its handler's writes wait while the front does not take
them; a caller that goes away (HAProxy closes the connection: `option abortonclose`) has its
call cancelled.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import logging
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

import grpc
import httptools

from service.api.stream import MessageContext

__all__ = ["MAX_HEADER_BYTES", "MAX_PIPELINED", "STREAM_READ_AHEAD", "CallLane", "parse_timeout"]

log = logging.getLogger(__name__)

# The most header bytes a call may carry: gRPC's own default metadata limit, doubled.
MAX_HEADER_BYTES = 16 * 1024
# Messages a stream reads ahead of its handler before it stops reading the connection.
STREAM_READ_AHEAD = 64
# Calls a connection may send before the one in flight is answered (HAProxy sends none): more
# end the connection, so that a caller cannot queue calls without bound.
MAX_PIPELINED = 8

# Headers that are the transport's, not the call's metadata (gRPC leaves them out too).
_TRANSPORT_HEADERS = frozenset(
    (
        b"host",
        b"content-type",
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"te",
        b"grpc-timeout",
        b"grpc-encoding",
        b"grpc-accept-encoding",
    )
)
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
# grpc-message is percent-encoded: printable ASCII but `%` goes as it is.
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")

_OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n"
_OK_TRAILERS = b"0\r\ngrpc-status: 0\r\n\r\n"
_CLOSE = b"connection: close\r\n"
_CLOSE_WAIT_S = 1.0  # how long a failed connection's last answer may wait to be read
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def parse_timeout(value: bytes) -> float | None:
    """A `grpc-timeout` header's seconds (`100m`, `5S`...); None where it does not parse."""
    digits, unit = value[:-1], value[-1:]
    scale = _TIMEOUT_UNITS.get(unit)
    if scale is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * scale


class _CallDetails(grpc.HandlerCallDetails):
    """What an interceptor reads of a call before its handler is chosen."""

    def __init__(self, method: str, invocation_metadata: tuple[tuple[str, Any], ...]) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class CallContext(MessageContext):
    """What the handlers and interceptors read of a call's context, for a call on the lane: a
    stream message's context (`service.api.stream`), with a deadline that may be None and the
    status setters and auth context a grpc.aio context has.
    """

    __slots__ = ()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}  # the front holds the TLS; the lane is plaintext on a private socket


class _StreamContext(CallContext):
    """A stream call's context: its answers written as they come (`write`)."""

    __slots__ = ("_call",)

    def __init__(self, call: _StreamCall, metadata: Any, deadline: float | None) -> None:
        super().__init__(metadata, deadline)
        self._call = call

    async def send_initial_metadata(self, _metadata: Any = ()) -> None:
        self._call.connection.send_head()

    async def write(self, message: Any) -> None:
        await self._call.connection.send_message(self._call.serialize(message))


class _StreamCall:
    """One stream's messages as they arrive (its request iterator) and its context."""

    def __init__(self, connection: _Connection, max_message_bytes: int) -> None:
        self.connection = connection
        self.max_message_bytes = max_message_bytes
        self.buffer = bytearray()
        self.frames: deque[bytes] = deque()
        self.ended = False
        self.failure: tuple[grpc.StatusCode, str] | None = None  # why it stopped reading
        self.encoding = b""
        self.deserialize: Callable[[bytes], Any] = bytes
        self.serialize: Callable[[Any], bytes] = bytes
        self._waiting: asyncio.Future[None] | None = None

    def feed(self, data: bytes) -> None:
        """A chunk of the request body: the messages it completes wait for the handler."""
        if self.ended:
            return
        self.buffer += data
        while len(self.buffer) >= 5:
            size = int.from_bytes(self.buffer[1:5], "big")
            if size > self.max_message_bytes:
                self._fail(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({size} vs. {self.max_message_bytes})",
                )
                return
            if len(self.buffer) < 5 + size:
                break
            self.frames.append(bytes(self.buffer[: 5 + size]))
            del self.buffer[: 5 + size]
        if len(self.frames) >= STREAM_READ_AHEAD:
            self.connection.pause_reading()
        self._wake()

    def end(self) -> None:
        """The caller half-closed: the iterator ends once its messages are taken."""
        if self.buffer and self.failure is None:
            self._fail(grpc.StatusCode.INTERNAL, "the stream ended inside a message")
        self.ended = True
        self._wake()

    def _fail(self, code: grpc.StatusCode, details: str) -> None:
        self.failure = (code, details)
        self.ended = True
        self.buffer.clear()
        self.frames.clear()
        self._wake()

    def _wake(self) -> None:
        waiting = self._waiting
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    def __aiter__(self) -> _StreamCall:
        return self

    async def __anext__(self) -> Any:
        if self.frames:
            # One message a turn of the loop, as gRPC's transport reads them: the turn's end
            # queues what was read, and answers come back in between.
            await asyncio.sleep(0)
        while not self.frames:
            if self.ended:
                raise StopAsyncIteration
            self._waiting = asyncio.get_running_loop().create_future()
            try:
                await self._waiting
            finally:
                self._waiting = None
        frame = self.frames.popleft()
        if len(self.frames) < STREAM_READ_AHEAD // 2:
            self.connection.resume_reading()
        message = _inflated(frame, self.encoding, self.max_message_bytes)
        if isinstance(message, tuple):
            self._fail(*message)
            raise StopAsyncIteration
        return self.deserialize(message)


def _inflated(frame: bytes, encoding: bytes, limit: int) -> bytes | tuple[grpc.StatusCode, str]:
    """A length-prefixed message's bytes, inflated where compressed; or the status that
    refuses it."""
    if frame[0] == 0:
        return frame[5:]
    if frame[0] != 1 or encoding in (b"", b"identity"):
        return grpc.StatusCode.INTERNAL, "a compressed message with no grpc-encoding to inflate it"
    if encoding not in (b"gzip", b"deflate"):
        kind = encoding.decode("ascii", "replace")
        return grpc.StatusCode.UNIMPLEMENTED, f"grpc-encoding {kind} is not supported"
    inflate = zlib.decompressobj(31 if encoding == b"gzip" else 15)
    broken = (grpc.StatusCode.INTERNAL, f"the {encoding.decode()} message does not inflate")
    try:
        message = inflate.decompress(frame[5:], limit + 1)
    except zlib.error:
        return broken
    if len(message) > limit:
        return grpc.StatusCode.RESOURCE_EXHAUSTED, (
            f"Received message larger than max (over {limit} inflated)"
        )
    if not inflate.eof or inflate.unused_data:  # cut short (no checksum), or more after it
        return broken
    return message


class _Request:
    __slots__ = ("body", "body_bytes", "header_bytes", "headers", "path", "received")

    def __init__(self) -> None:
        self.path = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.received = 0.0


class CallLane:
    """Unary calls and bidirectional streams over HTTP/1.1 on a Unix socket, answered by a
    server's method handlers."""

    def __init__(
        self,
        handlers: Sequence[grpc.GenericRpcHandler],
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_message_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self._generic = tuple(handlers)
        self._interceptors = tuple(interceptors)
        self.max_message_bytes = max_message_bytes
        self._methods: dict[bytes, grpc.RpcMethodHandler] = {}
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self.draining = False

    async def start(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path)

    def method(self, path: bytes) -> grpc.RpcMethodHandler | None:
        """The registered handler of `path`, as grpc.aio finds it (None: no such method)."""
        try:
            return self._methods[path]
        except KeyError:
            pass
        found = None
        details = _CallDetails(path.decode("ascii", "replace"), ())
        for generic in self._generic:
            found = generic.service(details)
            if found is not None:
                self._methods[path] = found  # only the registered methods, so a few
                break
        return found

    async def handler(
        self, path: bytes, metadata: tuple[tuple[str, Any], ...]
    ) -> grpc.RpcMethodHandler | None:
        """The handler for one call: the method's, behind the interceptors."""
        found = self.method(path)
        if found is None or not self._interceptors:
            return found
        details = _CallDetails(path.decode("ascii", "replace"), metadata)

        async def chain(index: int, call: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if index == len(self._interceptors):
                return found
            return await self._interceptors[index].intercept_service(
                lambda next_call: chain(index + 1, next_call), call
            )

        return await chain(0, details)

    async def close(self, grace_s: float) -> None:
        """Stop taking connections; answer the calls in flight within `grace_s`, then cancel
        what is left. Idle connections close at once, busy ones after their answer."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for connection in tuple(self._connections):
            connection.close_when_idle()
        busy = [c.current for c in self._connections if c.current is not None]
        if busy:
            await asyncio.wait(busy, timeout=grace_s)
        for connection in tuple(self._connections):
            if connection.current is not None:  # past the grace: cancelled, unanswered
                connection.abort()
        if self._server is not None:
            # Since Python 3.12 this waits for every connection, one whose peer reads nothing
            # included: a second more at most.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), _CLOSE_WAIT_S)


class _Connection(asyncio.Protocol):
    """One connection from the front: its calls, one at a time, in order."""

    def __init__(self, lane: CallLane) -> None:
        self._lane = lane
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._request = _Request()
        self._pending: deque[_Request] = deque()
        self.current: asyncio.Task[None] | None = None
        self._closing = False
        self._stream: _StreamCall | None = None  # the stream this connection carries
        self._head_sent = False  # a stream's response head
        self._writable: asyncio.Future[None] | None = None  # set while writes are paused
        self._out: list[bytes] = []  # a stream's writes of this turn of the loop
        self._flush_scheduled = False
        self._reading = True

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._lane._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lane._connections.discard(self)
        self._closing = True
        self._pending.clear()
        self.resume_writing()
        if self.current is not None:
            self.current.cancel()  # the caller went away: its call is not answered

    def pause_writing(self) -> None:
        """The caller is not reading: a stream's writes wait; unary calls stop being read
        and started, so that their answers do not pile up here."""
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()
        if self._stream is None:
            self.pause_reading()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)
        if self._stream is None and not self._closing:
            self.resume_reading()
            if self.current is None and self._pending:
                self._next()

    def pause_reading(self) -> None:
        if self._reading and self._transport is not None and not self._transport.is_closing():
            self._reading = False
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if not self._reading and self._transport is not None and not self._transport.is_closing():
            self._reading = True
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail_connection()

    # httptools' callbacks

    def on_message_begin(self) -> None:
        self._request = _Request()
        self._request.received = time.monotonic()

    def on_url(self, url: bytes) -> None:
        request = self._request
        request.header_bytes += len(url)
        if request.header_bytes <= MAX_HEADER_BYTES:
            request.path += url

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self._request
        request.header_bytes += len(name) + len(value)
        if request.header_bytes <= MAX_HEADER_BYTES:
            request.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        found = self._lane.method(self._request.path)
        if found is None or found.stream_stream is None or self.current is not None:
            return  # a unary call (or none): answered once its body is complete
        self._stream = _StreamCall(self, self._lane.max_message_bytes)
        self.current = asyncio.get_running_loop().create_task(
            self._stream_call(self._request, self._stream)
        )
        self.current.add_done_callback(self._called)

    def on_body(self, body: bytes) -> None:
        if self._stream is not None:
            self._stream.feed(body)
            return
        request = self._request
        request.body_bytes += len(body)
        if request.body_bytes <= self._lane.max_message_bytes + 5:
            request.body.append(body)
        else:
            request.body.clear()  # answered RESOURCE_EXHAUSTED; its bytes are not kept

    def on_message_complete(self) -> None:
        if self._stream is not None:
            self._stream.end()
            return
        if self._parser.get_method() != b"POST" or len(self._pending) >= MAX_PIPELINED:
            self._fail_connection()
            return
        self._pending.append(self._request)
        if self.current is None:
            self._next()

    # calls

    def _next(self) -> None:
        if self._closing or not self._pending:
            self.current = None
            if self._closing and self._transport is not None:
                self._transport.close()
            return
        if self._writable is not None:
            return  # the caller reads no answers: the next call starts when it does
        request = self._pending.popleft()
        self.current = asyncio.get_running_loop().create_task(self._call(request))
        self.current.add_done_callback(self._called)

    def _called(self, task: asyncio.Task[None]) -> None:
        self.current = None
        if not task.cancelled() and task.exception() is not None:
            log.error("a call on the lane failed", exc_info=task.exception())
            self._fail_connection()
            return
        if self._lane.draining:
            self._closing = True
        self._next()

    async def _call(self, request: _Request) -> None:
        lane = self._lane
        metadata, deadline, encoding = _metadata(request)
        if request.header_bytes > MAX_HEADER_BYTES:
            self._status(grpc.StatusCode.RESOURCE_EXHAUSTED, "the call's metadata is too large")
            return
        handler = await lane.handler(request.path, metadata)
        if handler is None or handler.unary_unary is None:
            name = request.path.decode("ascii", "replace")
            self._status(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {name}")
            return
        message = self._message(request, encoding)
        if isinstance(message, tuple):
            self._status(*message)
            return
        context = CallContext(metadata, deadline)
        try:
            reply = await handler.unary_unary(handler.request_deserializer(message), context)
        except grpc.aio.AbortError:
            self._status(context.code(), context.details())
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("a handler failed outside the RPC boundary")
            self._status(grpc.StatusCode.UNKNOWN, "Unexpected error in the handler")
            return
        self._answer(handler.response_serializer(reply))

    async def _stream_call(self, request: _Request, call: _StreamCall) -> None:
        """One stream: its handler reads `call` and writes its answers as they come."""
        self._closing = True  # the connection closes when the stream ends
        metadata, deadline, call.encoding = _metadata(request)
        if request.header_bytes > MAX_HEADER_BYTES:
            self._status(grpc.StatusCode.RESOURCE_EXHAUSTED, "the call's metadata is too large")
            return
        handler = await self._lane.handler(request.path, metadata)
        if handler is None or handler.stream_stream is None:  # an interceptor's choice
            name = request.path.decode("ascii", "replace")
            self._status(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {name}")
            return
        call.deserialize = handler.request_deserializer
        call.serialize = handler.response_serializer
        context = _StreamContext(call, metadata, deadline)
        try:
            result = handler.stream_stream(call, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    await context.write(item)
            else:
                await result
        except grpc.aio.AbortError:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("a stream handler failed outside the RPC boundary")
            context.set_code(grpc.StatusCode.UNKNOWN)
            context.set_details("Unexpected error in the handler")
        code, details = context.code(), context.details()
        if call.failure is not None and code is grpc.StatusCode.OK:
            code, details = call.failure
        if not self._head_sent:
            self._status(code, details)
            return
        self._out.append(b"0\r\n%s\r\n" % _status_fields(code, details))
        self._flush()

    def send_head(self) -> None:
        """A stream's response head, once, before its first answer."""
        if not self._head_sent:
            self._head_sent = True
            self._out.append(_OK_HEAD + _CLOSE + b"\r\n")
            self._flush_soon()

    async def send_message(self, payload: bytes) -> None:
        """One of a stream's answers as a chunk; waits while the front takes no more.

        The answers of one turn of the event loop leave in one write (one system call),
        as gRPC's own transport gathers its frames."""
        self.send_head()
        self._out += _chunk(payload)
        self._flush_soon()
        if self._writable is not None:
            await self._writable

    def _flush_soon(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        transport = self._transport
        if out and transport is not None and not transport.is_closing():
            transport.write(b"".join(out))

    def _message(self, request: _Request, encoding: bytes) -> bytes | tuple[grpc.StatusCode, str]:
        """The call's one message, or the status that refuses it."""
        limit = self._lane.max_message_bytes
        if request.body_bytes > limit + 5:
            return (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Received message larger than max ({request.body_bytes - 5} vs. {limit})",
            )
        body = b"".join(request.body)
        if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            return grpc.StatusCode.INTERNAL, "the request is not one length-prefixed message"
        return _inflated(body, encoding, limit)

    def _answer(self, payload: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        head = _OK_HEAD + (_CLOSE if self._lane.draining else b"")
        transport.write(b"".join((head, b"\r\n", *_chunk(payload), _OK_TRAILERS)))

    def _status(self, code: grpc.StatusCode, details: str) -> None:
        """A failed call's answer in gRPC's trailers-only form: the status in the headers."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        close = _CLOSE if self._lane.draining or self._closing else b""
        transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\n%scontent-length: 0\r\n%s\r\n"
            % (_status_fields(code, details), close)
        )

    def close_when_idle(self) -> None:
        self._closing = True
        if self.current is None and self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def _fail_connection(self) -> None:
        self._closing = True
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(_BAD_REQUEST)
            transport.close()
            # A caller that reads nothing would hold the connection while the answer waits.
            asyncio.get_running_loop().call_later(_CLOSE_WAIT_S, transport.abort)


def _chunk(payload: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """One message as a chunk of a response body: its size, gRPC's length prefix (no
    compression), the message, the chunk's end."""
    return b"%x\r\n\x00" % (len(payload) + 5), len(payload).to_bytes(4, "big"), payload, b"\r\n"


def _status_fields(code: grpc.StatusCode, details: str) -> bytes:
    """`grpc-status` and `grpc-message` as header or trailer lines."""
    message = quote(details, safe=_MESSAGE_SAFE).encode("ascii")
    return b"grpc-status: %d\r\ngrpc-message: %s\r\n" % (code.value[0], message)


def _metadata(request: _Request) -> tuple[tuple[tuple[str, Any], ...], float | None, bytes]:
    """A request's metadata as grpc.aio gives it (`-bin` values decoded), its deadline and
    its message encoding."""
    pairs: list[tuple[str, Any]] = []
    deadline = None
    encoding = b""
    for name, value in request.headers:
        if name in _TRANSPORT_HEADERS:
            if name == b"grpc-timeout":
                seconds = parse_timeout(value)
                if seconds is not None:
                    deadline = request.received + seconds
            elif name == b"grpc-encoding":
                encoding = value
            continue
        key = name.decode("latin-1")
        if key.endswith("-bin"):
            with contextlib.suppress(ValueError):
                pairs.append((key, base64.b64decode(value + b"==")))
            continue
        pairs.append((key, value.decode("latin-1")))
    return tuple(pairs), deadline, encoding
