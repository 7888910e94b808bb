"""TLS and mutual TLS on the gRPC port, with certificates rotated while the server runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import grpc
import pydantic
import pytest
from certs import Authority, write_atomically
from grpc_health.v1 import health_pb2, health_pb2_grpc
from liveserver import REPO, LiveServer, server_process
from modelkit import write_tabular_model

from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.config import Settings


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls-models")
    write_tabular_model(root)
    return root


@pytest.fixture
def pki(tmp_path):
    ca = Authority()
    server = ca.issue("riskserve", server=True)
    files = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    write_atomically(files["cert"], server.cert_pem)
    write_atomically(files["key"], server.key_pem)
    write_atomically(files["ca"], ca.pem)
    return ca, files


def serve(models, files, **settings) -> LiveServer:
    return LiveServer(
        models_dir=models,
        default_model="credit-lite",
        tls_cert_file=files["cert"],
        tls_key_file=files["key"],
        tls_reload_interval_s=0,
        budget_ms=2000,
        onnx_variants=False,
        **settings,
    )


def score(channel: grpc.Channel) -> pb.ScoreResponse:
    request = pb.ScoreRequest(request_id="1", features={f"f{j}": 0.1 for j in range(5)})
    return pb_grpc.RiskScoringStub(channel).Score(request, timeout=5)


def secure(target: str, root_pem: bytes, client=None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=root_pem,
        private_key=client.key_pem if client else None,
        certificate_chain=client.cert_pem if client else None,
    )
    return grpc.secure_channel(target, credentials)


def fails(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        score(channel)
    return err.value.code()


def test_tls_client_is_served_and_plaintext_is_not(models, pki):
    ca, files = pki
    with serve(models, files) as server:
        with secure(server.target, ca.pem) as channel:
            assert score(channel).model == "credit-lite"
        with grpc.insecure_channel(server.target) as channel:
            assert fails(channel) == grpc.StatusCode.UNAVAILABLE
        with secure(server.target, Authority("someone else").pem) as channel:
            assert fails(channel) == grpc.StatusCode.UNAVAILABLE  # server not trusted


def test_mutual_tls_requires_a_client_certificate_from_the_ca(models, pki):
    ca, files = pki
    with serve(models, files, tls_client_ca_file=files["ca"]) as server:
        with secure(server.target, ca.pem, ca.issue("scorer", server=False)) as channel:
            assert score(channel).model == "credit-lite"
        with secure(server.target, ca.pem) as channel:
            assert fails(channel) == grpc.StatusCode.UNAVAILABLE
        stranger = Authority("stranger").issue("scorer", server=False)
        with secure(server.target, ca.pem, stranger) as channel:
            assert fails(channel) == grpc.StatusCode.UNAVAILABLE


def test_rotated_certificate_is_used_without_restart(models, pki):
    ca, files = pki
    with serve(models, files) as server:
        with secure(server.target, ca.pem) as channel:
            score(channel)
        new_ca = Authority("rotated CA")
        rotated = new_ca.issue("riskserve", server=True)
        write_atomically(files["key"], rotated.key_pem)
        write_atomically(files["cert"], rotated.cert_pem)
        # New connections get the new chain: clients trusting only the new CA now connect...
        with secure(server.target, new_ca.pem) as channel:
            assert score(channel).model == "credit-lite"
        # ... and those trusting only the old one no longer do.
        with secure(server.target, ca.pem) as channel:
            assert fails(channel) == grpc.StatusCode.UNAVAILABLE
        assert server.server is not None and server.server.certificates is not None
        assert server.server.certificates.reloads == 1


def test_a_broken_rotation_keeps_the_old_certificate(models, pki):
    ca, files = pki
    with serve(models, files) as server:
        write_atomically(files["cert"], b"not a certificate")
        with secure(server.target, ca.pem) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_key_that_is_not_the_certificates_is_named_at_start_and_not_rotated_to(models, pki):
    """gRPC takes a mismatched pair without a word and then fails to bind, which read as a
    port in use. Checked as OpenSSL reads the files: a start names them, a rotation to such a
    pair keeps the old certificates and is not counted."""
    ca, files = pki
    stranger = ca.issue("someone-else", server=True)
    env = {
        **os.environ,
        "RISKSERVE_MODELS_DIR": str(models),
        "RISKSERVE_DEFAULT_MODEL": "credit-lite",
        "RISKSERVE_PORT": "0",
        "RISKSERVE_METRICS_PORT": "none",
        "RISKSERVE_TRACE_FILE": "none",
        "RISKSERVE_ONNX_VARIANTS": "false",
        "RISKSERVE_TLS_CERT_FILE": str(files["cert"]),
        "RISKSERVE_TLS_KEY_FILE": str(files["key"]),
    }
    with serve(models, files) as server:
        write_atomically(files["key"], stranger.key_pem)
        with secure(server.target, ca.pem) as channel:
            assert score(channel).score > 0
        assert server.server is not None and server.server.certificates is not None
        assert server.server.certificates.reloads == 0
    done = subprocess.run(
        [sys.executable, "-m", "service", "serve"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr
    assert f"{files['cert']} and {files['key']} are not a certificate and its key" in last


def test_plaintext_is_refused_off_loopback_unless_allowed(models):
    with pytest.raises(pydantic.ValidationError, match="plaintext"):
        Settings(host="0.0.0.0", models_dir=models)
    assert Settings(host="0.0.0.0", models_dir=models, allow_insecure=True).allow_insecure
    assert Settings(host="::1", models_dir=models).host == "::1"  # loopback needs no TLS


def test_tls_settings_come_in_pairs(models, pki):
    _, files = pki
    with pytest.raises(pydantic.ValidationError, match="together"):
        Settings(models_dir=models, tls_cert_file=files["cert"])


PLAINTEXT_CLIENTS = 200


def _plaintext_connection(port: int) -> None:
    """An HTTP/2 client without TLS: the server's handshake fails and it closes the socket,
    which this waits for (so the server has handled the connection when it returns)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass


def _handshake_log_lines(models, files, **env: str) -> list[str]:
    """The `riskserve serve` process's log lines about failed handshakes, after
    PLAINTEXT_CLIENTS plaintext connections to its TLS port, read to the process's exit."""
    output: list[str] = []
    with server_process(
        models,
        output=output,
        RISKSERVE_DEFAULT_MODEL="credit-lite",
        RISKSERVE_ONNX_VARIANTS="false",
        RISKSERVE_TLS_CERT_FILE=str(files["cert"]),
        RISKSERVE_TLS_KEY_FILE=str(files["key"]),
        **env,
    ) as (_, target):
        port = int(target.rsplit(":", 1)[1])
        for _ in range(PLAINTEXT_CLIENTS):
            _plaintext_connection(port)
    return [line for line in output if "andshake" in line]


def test_plaintext_connections_to_the_tls_port_log_no_line_each(models, pki, monkeypatch):
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    _, files = pki
    assert _handshake_log_lines(models, files) == []


def test_an_exported_grpc_verbosity_still_shows_each_handshake(models, pki):
    """The operator's GRPC_VERBOSITY wins: INFO shows the lines the default leaves out."""
    _, files = pki
    lines = _handshake_log_lines(models, files, GRPC_VERBOSITY="INFO")
    assert len(lines) >= PLAINTEXT_CLIENTS
