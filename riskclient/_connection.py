"""Where the server is and how to reach it: TLS, mutual TLS and a bearer token, mirroring the
server's settings (tls_cert_file / tls_key_file / tls_client_ca_file, auth_token)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

__all__ = ["Connection"]


@dataclass(frozen=True, slots=True)
class Connection:
    """How to reach a riskserve: its address, TLS files and bearer token.

    TLS is on when `tls` is true or any TLS file is given; without `tls_ca_file` the system's
    roots verify the server. `tls_cert_file` and `tls_key_file` are the client's certificate
    for mutual TLS. `auth_token` is sent as ``authorization: Bearer <token>`` on every call.
    """

    target: str = "127.0.0.1:50051"
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
