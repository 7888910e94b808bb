"""The call lane: a worker's unary gRPC calls from the front, over HTTP/1.1.

Behind the front, a unary call need not pay for gRPC's Python transport (about 0.2 ms of CPU a
call, more than the demo model's run): HAProxy speaks HTTP/2 to the caller and HTTP/1.1 to
this lane, one call a connection at a time, its connections kept open. The call keeps gRPC's
form: a POST to `/<service>/<method>` whose body is one length-prefixed message, and an answer
whose status travels in trailers (`grpc-status`, `grpc-message`), or, for a call that fails,
in the headers of an answer with no body, gRPC's trailers-only form, which HAProxy passes on as
one HEADERS frame (and counts by server, `service.front`). The parser is httptools (llhttp, the
C parser Node.js uses); what runs in Python a call is the servicer's own handler, behind the
same interceptors (authentication) and the same method handlers as on the gRPC port.

The lane listens on a Unix socket in the front's private folder and serves the front alone:
it takes no TLS, no stream RPC and no connection from a caller directly. A request's body is
bounded by the server's message limit, its headers by `MAX_HEADER_BYTES`; a caller that goes
away (HAProxy closes the connection: `option abortonclose`) has its call cancelled.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import quote

import grpc
import httptools

__all__ = ["MAX_HEADER_BYTES", "CallLane", "parse_timeout"]

log = logging.getLogger(__name__)

# The most header bytes a call may carry: gRPC's own default metadata limit, doubled.
MAX_HEADER_BYTES = 16 * 1024

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
_OK_TAIL = b"\r\n0\r\ngrpc-status: 0\r\n\r\n"
_CLOSE = b"connection: close\r\n"
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


class CallContext:
    """What the handlers and interceptors read of a call's context, for a call on the lane.

    `abort()` records the status and raises as grpc.aio's does, so the RPC boundary maps
    errors exactly as on the gRPC port.
    """

    __slots__ = ("_code", "_details", "_metadata", "deadline")

    def __init__(self, metadata: tuple[tuple[str, Any], ...], deadline: float | None) -> None:
        self._metadata = metadata
        self.deadline = deadline  # monotonic seconds, or None: no deadline
        self._code = grpc.StatusCode.OK
        self._details = ""

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details
        raise grpc.aio.AbortError()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}  # the front holds the TLS; the lane is plaintext on a private socket

    def peer(self) -> str:
        return "unix:front"


Handler = Callable[[Any, CallContext], Awaitable[Any]]


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
    """Unary calls over HTTP/1.1 on a Unix socket, answered by a server's method handlers."""

    def __init__(
        self,
        handlers: Sequence[grpc.GenericRpcHandler],
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_message_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self._generic = tuple(handlers)
        self._interceptors = tuple(interceptors)
        self.max_message_bytes = max_message_bytes
        self._methods: dict[bytes, grpc.RpcMethodHandler | None] = {}
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
        if len(self._methods) < 1024:  # the known methods are few; others are not kept
            name = path.decode("ascii", "replace")
            details = _CallDetails(name, ())
            for generic in self._generic:
                found = generic.service(details)
                if found is not None:
                    break
            if found is not None:
                self._methods[path] = found
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
            connection.abort()
        if self._server is not None:
            await self._server.wait_closed()


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

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._lane._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lane._connections.discard(self)
        self._closing = True
        self._pending.clear()
        if self.current is not None:
            self.current.cancel()  # the caller went away: its call is not answered

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
        self._request.path += url
        self._request.header_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self._request
        request.header_bytes += len(name) + len(value)
        if request.header_bytes <= MAX_HEADER_BYTES:
            request.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        request = self._request
        request.body_bytes += len(body)
        if request.body_bytes <= self._lane.max_message_bytes + 5:
            request.body.append(body)
        else:
            request.body.clear()  # answered RESOURCE_EXHAUSTED; its bytes are not kept

    def on_message_complete(self) -> None:
        if self._parser.get_method() != b"POST":
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
        if body[0] == 0:
            return body[5:]
        if body[0] != 1 or encoding not in (b"gzip", b"deflate"):
            kind = encoding.decode("ascii", "replace") or "none named"
            return grpc.StatusCode.UNIMPLEMENTED, f"grpc-encoding {kind} is not supported"
        window = 31 if encoding == b"gzip" else 15
        inflate = zlib.decompressobj(window)
        try:
            message = inflate.decompress(body[5:], limit + 1)
        except zlib.error:
            return grpc.StatusCode.INTERNAL, f"the {encoding.decode()} message does not inflate"
        if len(message) > limit:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"Received message larger than max (over {limit} inflated)"
            )
        return message

    def _answer(self, payload: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        size = len(payload) + 5
        head = _OK_HEAD + (_CLOSE if self._lane.draining else b"")
        transport.write(
            b"".join(
                (
                    head,
                    b"\r\n%x\r\n\x00" % size,
                    len(payload).to_bytes(4, "big"),
                    payload,
                    _OK_TAIL,
                )
            )
        )

    def _status(self, code: grpc.StatusCode, details: str) -> None:
        """A failed call's answer in gRPC's trailers-only form: the status in the headers."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        message = quote(details, safe=_MESSAGE_SAFE).encode("ascii")
        transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ngrpc-status: %d\r\n"
            b"grpc-message: %s\r\ncontent-length: 0\r\n%s\r\n"
            % (code.value[0], message, _CLOSE if self._lane.draining else b"")
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
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(_BAD_REQUEST)
            self._transport.close()


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
