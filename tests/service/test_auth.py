"""Bearer tokens and the mTLS identity allow-list, with health checking left open."""

from __future__ import annotations

import os
import time

import grpc
import pytest
from certs import Authority, write_atomically
from grpc_health.v1 import health_pb2, health_pb2_grpc
from liveserver import LiveServer
from modelkit import write_tabular_model
from scrape import scraped_total
from waiting import wait_until

from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth-models")
    write_tabular_model(root)
    return root


def serve(models, **settings) -> LiveServer:
    return LiveServer(
        models_dir=models,
        default_model="credit-lite",
        budget_ms=2000,
        onnx_variants=False,
        **settings,
    )


def score(channel, token: str | None = None, scheme: str = "Bearer") -> grpc.StatusCode:
    metadata = [("authorization", f"{scheme} {token}")] if token is not None else None
    request = pb.ScoreRequest(request_id="1", features={f"f{j}": 0.1 for j in range(5)})
    try:
        pb_grpc.RiskScoringStub(channel).Score(request, timeout=5, metadata=metadata)
    except grpc.RpcError as exc:
        assert "s3cret" not in (exc.details() or "")
        return exc.code()
    return grpc.StatusCode.OK


def health_check(channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_bearer_token(models):
    with serve(models, auth_token=TOKEN) as server, server.channel() as channel:
        assert score(channel) == grpc.StatusCode.UNAUTHENTICATED
        assert score(channel, "wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert score(channel, TOKEN[:-1]) == grpc.StatusCode.UNAUTHENTICATED
        assert score(channel, TOKEN, scheme="Basic") == grpc.StatusCode.UNAUTHENTICATED
        assert score(channel, TOKEN) == grpc.StatusCode.OK
        assert score(channel, TOKEN, scheme="bearer") == grpc.StatusCode.OK
        # Health checking stays open to probes; the OIP service is guarded like the domain API.
        assert health_check(channel) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            oip_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                oip.ServerLiveRequest(), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_refused_calls_are_counted_by_method_and_reason(models):
    with serve(models, auth_token=TOKEN, metrics_port=0) as server, server.channel() as channel:
        assert score(channel) == grpc.StatusCode.UNAUTHENTICATED
        assert score(channel, "wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert score(channel, TOKEN, scheme="Basic") == grpc.StatusCode.UNAUTHENTICATED
        assert score(channel, TOKEN) == grpc.StatusCode.OK
        with pytest.raises(grpc.RpcError):
            oip_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                oip.ServerLiveRequest(), timeout=5
            )
        url = server.server.telemetry.metrics_url

        def refused(**labels: str) -> float:
            return scraped_total(url, "riskserve_auth_refused_total", **labels)

        assert refused(method="Score", reason="missing_token") == 1
        assert refused(method="Score", reason="invalid_token") == 2
        assert refused(method="ServerLive", reason="missing_token") == 1
        assert refused() == 4  # the accepted call and health checks are not refusals


def test_tokens_file_is_reread_when_it_changes(models, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# one token a line\nfirst-token\n\n")
    with serve(models, auth_tokens_file=tokens) as server, server.channel() as channel:
        assert score(channel, "first-token") == grpc.StatusCode.OK
        assert score(channel, "second-token") == grpc.StatusCode.UNAUTHENTICATED
        tokens.write_text("second-token\n")
        stamp = time.time() + 5  # a distinct mtime, whatever the filesystem's resolution
        os.utime(tokens, (stamp, stamp))
        wait_until(lambda: score(channel, "second-token") == grpc.StatusCode.OK)
        assert score(channel, "first-token") == grpc.StatusCode.UNAUTHENTICATED


def test_mtls_identity_allow_list(models, tmp_path):
    ca = Authority()
    files = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    pair = ca.issue("riskserve", server=True)
    write_atomically(files["cert"], pair.cert_pem)
    write_atomically(files["key"], pair.key_pem)
    write_atomically(files["ca"], ca.pem)
    settings = {
        "tls_cert_file": files["cert"],
        "tls_key_file": files["key"],
        "tls_client_ca_file": files["ca"],
        "auth_client_names": ("decision-engine",),
        "metrics_port": 0,
    }

    def channel_as(name: str) -> grpc.Channel:
        client = ca.issue(name, server=False)
        credentials = grpc.ssl_channel_credentials(ca.pem, client.key_pem, client.cert_pem)
        return grpc.secure_channel(server.target, credentials)

    with serve(models, **settings) as server:
        with channel_as("decision-engine") as channel:
            assert score(channel) == grpc.StatusCode.OK
        with channel_as("someone-else") as channel:
            assert score(channel) == grpc.StatusCode.UNAUTHENTICATED
            assert health_check(channel) == health_pb2.HealthCheckResponse.SERVING
        url = server.server.telemetry.metrics_url
        assert scraped_total(url, "riskserve_auth_refused_total", reason="client_identity") == 1
