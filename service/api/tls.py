"""TLS server credentials from PEM files, re-read when the files change, without a restart.

gRPC asks `CertificateFiles.fetch` for a configuration at each TLS handshake; it answers None
(keep the current one) unless a file's mtime changed since the last read. Rotate certificates by
replacing the files atomically (write beside, then rename), as Kubernetes secret volumes and
cert-manager do: a reader never sees half a key. A rotation that does not parse is logged and
the old certificates stay in use.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from pathlib import Path

import grpc

__all__ = ["CertificateFiles"]

log = logging.getLogger(__name__)

_Stamp = tuple[tuple[int, int], ...]


class CertificateFiles:
    """The server's key and chain, and optionally the client CA that makes TLS mutual."""

    def __init__(
        self, cert_file: Path, key_file: Path, client_ca_file: Path | None, check_interval_s: float
    ) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.client_ca_file = client_ca_file
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._checked_at = time.monotonic()
        self._stamp = self._mtimes()
        self.reloads = 0

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._read(), self.fetch, require_client_authentication=self.mutual
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration if the files changed since the last read, else None."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at < self.check_interval_s:
                return None
            self._checked_at = now
            try:
                stamp = self._mtimes()
                if stamp == self._stamp:
                    return None
                config = self._read()
            except (OSError, ValueError) as exc:
                log.warning("TLS files changed but could not be read; keeping the old: %s", exc)
                return None
            self._stamp = stamp
            self.reloads += 1
            log.info("TLS certificates reloaded from %s", self.cert_file)
            return config

    def _files(self) -> list[Path]:
        files = [self.cert_file, self.key_file]
        return files if self.client_ca_file is None else [*files, self.client_ca_file]

    def _mtimes(self) -> _Stamp:
        return tuple((s.st_mtime_ns, s.st_ino) for s in (p.stat() for p in self._files()))

    def _read(self) -> grpc.ServerCertificateConfiguration:
        key = self.key_file.read_bytes()
        chain = self.cert_file.read_bytes()
        if b"-----BEGIN" not in key or b"-----BEGIN" not in chain:
            raise ValueError("certificate or key file holds no PEM block")
        client_ca = self.client_ca_file.read_bytes() if self.client_ca_file else None
        self._check_pair()
        return grpc.ssl_server_certificate_configuration(
            [(key, chain)], root_certificates=client_ca
        )

    def _check_pair(self) -> None:
        """The files as OpenSSL reads them: gRPC takes a key that is not the certificate's, or a
        corrupt block, without a word and then fails to bind, as if the port were taken."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as exc:
            raise ValueError(
                f"{self.cert_file} and {self.key_file} are not a certificate and its key: {exc}"
            ) from exc
        if self.client_ca_file is not None:
            try:
                context.load_verify_locations(self.client_ca_file)
            except ssl.SSLError as exc:
                raise ValueError(f"{self.client_ca_file} holds no usable CA: {exc}") from exc
