"""The client reaches a server that requires TLS, a client certificate and a bearer token."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from certs import Authority, write_atomically
from liveserver import LiveServer
from modelkit import write_tabular_model

from riskclient import AsyncRiskClient, Connection, RiskClient, ScoringError

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("client-tls")
    write_tabular_model(root / "models")
    ca = Authority()
    server, client = ca.issue("riskserve", server=True), ca.issue("caller", server=False)
    files = {}
    for name, data in {
        "cert": server.cert_pem,
        "key": server.key_pem,
        "ca": ca.pem,
        "client-cert": client.cert_pem,
        "client-key": client.key_pem,
    }.items():
        files[name] = root / f"{name}.pem"
        write_atomically(files[name], data)
    with LiveServer(
        models_dir=root / "models",
        default_model="credit-lite",
        tls_cert_file=files["cert"],
        tls_key_file=files["key"],
        tls_client_ca_file=files["ca"],
        auth_token=TOKEN,
        budget_ms=2000,
        onnx_variants=False,
    ) as live:
        yield live, files


def request(i: int) -> dict:
    return {"request_id": f"t{i}", "features": {f"f{j}": 0.1 * j for j in range(5)}}


def connection(live, files, token: str | None = TOKEN) -> Connection:
    return Connection(
        live.target,
        tls_ca_file=files["ca"],
        tls_cert_file=files["client-cert"],
        tls_key_file=files["client-key"],
        auth_token=token,
    )


def test_unary_and_stream_calls_carry_tls_and_the_token(secured):
    live, files = secured
    with RiskClient(connection=connection(live, files), timeout_s=5) as client:
        assert client.score(request(1)).model == "credit-lite"
        with client.stream() as stream:
            assert stream.score(request(2)).request_id == "t2"

    async def run():
        client = AsyncRiskClient(connection=connection(live, files), timeout_s=5)
        async with client, client.stream() as stream:
            return await asyncio.gather(*(stream.score(request(i)) for i in range(10)))

    assert [r.request_id for r in asyncio.run(run())] == [f"t{i}" for i in range(10)]


def test_a_wrong_token_is_unauthenticated_on_both_paths(secured):
    live, files = secured
    with RiskClient(connection=connection(live, files, token="wrong"), timeout_s=5) as client:
        with pytest.raises(ScoringError) as unary:
            client.score(request(1))
        with client.stream() as stream, pytest.raises(ScoringError) as streamed:
            stream.score(request(2))
    assert unary.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert streamed.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_tls_files_come_in_pairs(tmp_path):
    with pytest.raises(ValueError, match="together"):
        Connection(tls_cert_file=tmp_path / "cert.pem")


def test_without_a_target_the_client_finds_the_server_as_the_cli_does(live, monkeypatch):
    """RISKSERVE_PORT (and RISKSERVE_HOST, a wildcard bind reached on loopback) name the
    server, as for the `riskserve` commands: a server on another port than 50051 answers."""
    monkeypatch.setenv("RISKSERVE_PORT", str(live.port))
    monkeypatch.setenv("RISKSERVE_HOST", "0.0.0.0")
    with RiskClient(timeout_s=10) as client:
        assert client.connection.target == live.target
        reply = client.score({**request(7), "model": "credit-lite"})
    assert reply.request_id == "t7"


def test_a_port_a_client_cannot_reach_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("RISKSERVE_PORT", "0")
    with pytest.raises(ValueError, match="RISKSERVE_PORT='0'"):
        Connection()
