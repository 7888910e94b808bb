"""Where the server is and how to reach it: TLS, mutual TLS and a bearer token, mirroring the
server's settings (tls_cert_file / tls_key_file / tls_client_ca_file, auth_token)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

__all__ = ["Connection", "default_target", "reachable"]

# The server's own defaults for RISKSERVE_HOST and RISKSERVE_PORT (service/config.py).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051


def reachable(host: str, port: int | str) -> str:
    """`host:port` as a client on this host reaches a server bound there (a wildcard address
    on loopback; an IPv6 address in brackets)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def default_target() -> str:
    """The server that `riskserve serve` would start here: RISKSERVE_HOST and RISKSERVE_PORT,
    with the server's defaults.

    Read from the environment directly, with the same names and defaults as the server's
    settings: the client installs without the server's settings machinery (pydantic), so the
    server's config file (RISKSERVE_CONFIG_FILE) is not read here.
    """
    host = os.environ.get("RISKSERVE_HOST", DEFAULT_HOST)
    port = os.environ.get("RISKSERVE_PORT", str(DEFAULT_PORT)).strip()
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"RISKSERVE_PORT={port!r} is not a port a client can connect to")
    return reachable(host.strip(), int(port))


@dataclass(frozen=True, slots=True)
class Connection:
    """How to reach a riskserve: its address, TLS files and bearer token.

    Without a `target`, the address is `default_target()`: RISKSERVE_HOST and RISKSERVE_PORT,
    as the `riskserve` commands find the server.
    TLS is on when `tls` is true or any TLS file is given; without `tls_ca_file` the system's
    roots verify the server. `tls_cert_file` and `tls_key_file` are the client's certificate
    for mutual TLS. `auth_token` is sent as ``authorization: Bearer <token>`` on every call.
    """

    target: str = field(default_factory=default_target)
    tls: bool = False
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_server_name: str | None = None
    auth_token: str | None = None
    options: Sequence[tuple[str, Any]] = ()

    def __post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")

    @property
    def secure(self) -> bool:
        return self.tls or self.tls_ca_file is not None or self.tls_cert_file is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else ()

    def _options(self) -> list[tuple[str, Any]]:
        options = list(self.options)
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return options

    def _credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.tls_ca_file),
            private_key=read(self.tls_key_file),
            certificate_chain=read(self.tls_cert_file),
        )

    def channel(self) -> grpc.Channel:
        """A blocking channel to the server."""
        if self.secure:
            return grpc.secure_channel(self.target, self._credentials(), self._options())
        return grpc.insecure_channel(self.target, self._options())

    def aio_channel(self) -> grpc.aio.Channel:
        """An asyncio channel to the server (create it inside the event loop that uses it)."""
        if self.secure:
            return grpc.aio.secure_channel(self.target, self._credentials(), self._options())
        return grpc.aio.insecure_channel(self.target, self._options())
