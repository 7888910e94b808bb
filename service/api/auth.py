"""Caller authentication: a bearer token and/or an allow-list of mTLS client identities.

`AuthInterceptor` guards every service except the open ones (health checking and reflection,
which probes and tools reach without credentials). A call without an accepted
``authorization: Bearer <token>`` header, or from a client certificate whose common name or
subject alternative names are not on the allow-list, ends with UNAUTHENTICATED before its
handler runs; the reply never says which part failed, the `riskserve.auth.refused` counter
(by method and reason) does.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

import grpc

from service.telemetry.metrics import Metrics

__all__ = ["AuthInterceptor", "TokenSource"]

log = logging.getLogger(__name__)

OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")
_IDENTITY_KEYS = ("x509_common_name", "x509_subject_alternative_name")

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
# Why a call is refused (one of metrics.AUTH_REFUSAL_REASONS), or None when it may proceed.
Refusal = Callable[[grpc.aio.ServicerContext], str | None]


def _digest(token: str | bytes) -> bytes:
    # Equal-length digests, so comparing takes the same time whatever the candidate's length.
    data = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(data).digest()


class TokenSource:
    """Accepted bearer tokens: a fixed one, and those in a file (one a line, # comments).

    The file is re-read when its mtime changes, checked at most every `check_interval_s`.
    """

    def __init__(
        self, token: str | None, tokens_file: Path | None, check_interval_s: float = 1.0
    ) -> None:
        self._fixed = [_digest(token)] if token else []
        self._file = tokens_file
        self._interval_s = check_interval_s
        self._lock = threading.Lock()
        self._checked_at = float("-inf")
        self._stamp: int | None = None
        self._from_file: list[bytes] = []

    def accepts(self, token: str) -> bool:
        given = _digest(token)
        # Compare with every token, not stopping at a match, so timing says nothing of which.
        matches = [hmac.compare_digest(given, known) for known in self._accepted()]
        return any(matches)

    def _accepted(self) -> list[bytes]:
        if self._file is None:
            return self._fixed
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at >= self._interval_s:
                self._checked_at = now
                self._refresh()
            return self._fixed + self._from_file

    def _refresh(self) -> None:
        assert self._file is not None
        try:
            stamp = self._file.stat().st_mtime_ns
            if stamp == self._stamp:
                return
            lines = self._file.read_text().splitlines()
        except OSError as exc:
            log.warning("cannot read the tokens file; keeping the tokens read before: %s", exc)
            return
        self._stamp = stamp
        tokens = [line.strip() for line in lines]
        self._from_file = [_digest(t) for t in tokens if t and not t.startswith("#")]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls to guarded services that lack an accepted credential."""

    def __init__(
        self,
        tokens: TokenSource | None,
        client_names: Collection[str] = (),
        open_services: Collection[str] = OPEN_SERVICES,
        metrics: Metrics | None = None,
    ) -> None:
        self._tokens = tokens
        self._client_names = frozenset(client_names)
        self._open = frozenset(open_services)
        self._metrics = metrics

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        if handler is None or service in self._open:
            return handler  # an unknown method is never counted: its name is the caller's
        token_refusal = self._token_refusal(handler_call_details.invocation_metadata)

        def refusal(context: grpc.aio.ServicerContext) -> str | None:
            reason = token_refusal or self._identity_refusal(context)
            if reason is not None and self._metrics is not None:
                self._metrics.count_auth_refused(method, reason)
            return reason

        return _guarded(handler, refusal)

    def _token_refusal(self, metadata: Any) -> str | None:
        if self._tokens is None:
            return None
        given = False
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str):
                given = True
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer" and self._tokens.accepts(token.strip()):
                    return None
        return "invalid_token" if given else "missing_token"

    def _identity_refusal(self, context: grpc.aio.ServicerContext) -> str | None:
        if not self._client_names:
            return None
        auth = context.auth_context()
        names = {v.decode() for key in _IDENTITY_KEYS for v in auth.get(key, ())}
        return None if not names.isdisjoint(self._client_names) else "client_identity"


async def _deny(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials")


def _guarded(handler: grpc.RpcMethodHandler, refusal: Refusal) -> grpc.RpcMethodHandler:
    """`handler` with `refusal(context)` checked before its behaviour runs."""
    if handler.unary_unary is not None or handler.stream_unary is not None:
        unary = handler.unary_unary or handler.stream_unary

        async def respond(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if refusal(context) is not None:
                await _deny(context)
            return await unary(request, context)

        make = (
            grpc.unary_unary_rpc_method_handler
            if handler.unary_unary is not None
            else grpc.stream_unary_rpc_method_handler
        )
    else:
        streaming = handler.unary_stream or handler.stream_stream

        async def respond(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # type: ignore[misc]
            if refusal(context) is not None:
                await _deny(context)
            result = streaming(request, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            else:
                await result

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream is not None
            else grpc.stream_stream_rpc_method_handler
        )
    return make(
        respond,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
