"""The `riskserve` client commands against a live server: JSON in, JSON out, the server's
own RISKSERVE_* settings to find it, and every error as one line on stderr."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from demo.generator import FEATURE_NAMES, HISTORY_FIELDS, generate


def run_cli(
    *args: str, stdin: str | None = None, **settings: str
) -> subprocess.CompletedProcess[str]:
    """`python -m service ARGS` with only the given RISKSERVE_* settings (`port="5"` sets
    RISKSERVE_PORT=5), none inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RISKSERVE_")}
    env |= {f"RISKSERVE_{name.upper()}": value for name, value in settings.items()}
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def one_line_error(done: subprocess.CompletedProcess[str], command: str) -> str:
    """The single stderr line of a failed command (no traceback), without its prefix."""
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"riskserve {command}: "), lines[0]
    return lines[0].removeprefix(f"riskserve {command}: ")


@pytest.fixture()
def closed_port() -> Iterator[int]:
    """A loopback port bound by nobody who listens: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_score_one_request_from_stdin(live):
    data = generate(1, seed=77)
    request = {
        "requestId": "cli-1",
        "entityId": data.entity_ids[0],
        "features": dict(zip(FEATURE_NAMES, data.features[0].tolist(), strict=True)),
        "history": [{"values": row.tolist()} for row in data.histories[0]],
    }
    done = run_cli("score", "--target", live.target, "-", stdin=json.dumps(request))
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["requestId"] == "cli-1"
    assert reply["decision"] in ("APPROVE", "REVIEW", "DECLINE")
    assert reply["engine"] == "onnxruntime-cpu"


def test_score_batch_and_error_status(live):
    items = [
        {
            "requestId": f"b{i}",
            "model": "credit-lite",
            "features": {f"f{j}": float(i + j) for j in range(5)},
        }
        for i in range(3)
    ]
    done = run_cli(
        "score", "--target", live.target, json.dumps({"model": "credit-lite", "requests": items})
    )
    assert done.returncode == 0, done.stderr
    assert [r["requestId"] for r in json.loads(done.stdout)["responses"]] == ["b0", "b1", "b2"]
    bad = run_cli("score", "--target", live.target, json.dumps({"features": {"nope": 1}}))
    assert bad.returncode == 1
    error = one_line_error(bad, "score")
    assert error.startswith("INVALID_ARGUMENT: ") and "features['nope']" in error


def test_info_prints_schema(live):
    done = run_cli("info", "--target", live.target, "--model", "fraud-demo")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["historyFields"] == list(HISTORY_FIELDS)


def test_info_shows_the_batch_limits_the_server_uses(live):
    """The rows the server batches at most (the `live` server's max_batch_size is 32), and
    apart from it the manifest's limit on requests in one ScoreBatch call."""
    done = run_cli("info", "--target", live.target, "--model", "fraud-demo")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["maxBatchSize"] == 32
    manifest = live.server.registry.get("fraud-demo").manifest
    assert info["maxScoreBatchRequests"] == manifest.max_batch_size == 256


def test_readme_quick_start_request(live, tmp_path):
    """The README's quick start: a sample request from the demo, scored by the CLI."""
    sample = subprocess.run(
        [sys.executable, "-m", "demo.sample_request"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    path = tmp_path / "request.json"
    path.write_text(sample.stdout)
    done = run_cli("score", "--target", live.target, str(path))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requestId"] == "demo-0"


def _explained_request(live) -> dict:
    """A demo request the model gives reasons for (an adverse contribution or more)."""
    from google.protobuf import json_format

    from demo.sample_request import sample_request
    from riskscoring.v1 import risk_scoring_pb2 as pb
    from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

    with live.channel() as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        for index in range(64):
            request = sample_request(seed=3, index=index)
            message = json_format.ParseDict(request, pb.ScoreRequest())
            message.explain_top_k, message.explain_when = 3, pb.EXPLAIN_ALWAYS
            if stub.Score(message, timeout=30).reasons:
                return request
    raise AssertionError("no demo request with reasons")


def test_explain_prints_the_reasons_with_the_score_on_stdout(live, tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(_explained_request(live)))
    done = run_cli("score", "--target", live.target, "--explain", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # stderr is for errors
    reply = json.loads(done.stdout)
    assert reply["reasons"] and all(r["code"] and r["text"] for r in reply["reasons"])


def test_explain_on_a_batch_is_refused_in_one_line(live):
    batch = json.dumps([{"requestId": "b0", "features": {}}, {"requestId": "b1", "features": {}}])
    for payload in (batch, json.dumps({"requests": json.loads(batch)})):
        done = run_cli("score", "--target", live.target, "--explain", payload)
        assert done.returncode == 2
        error = one_line_error(done, "score")
        assert error.startswith("--explain takes one request, not a batch"), error


def test_clients_find_the_server_from_its_settings(live):
    """No --target: `info` and `score` read RISKSERVE_HOST and RISKSERVE_PORT, as the server."""
    done = run_cli("info", "--model", "fraud-demo", port=str(live.port))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["historyFields"] == list(HISTORY_FIELDS)
    # The server's wildcard bind address is reached on loopback.
    done = run_cli("info", "--model", "fraud-demo", port=str(live.port), host="0.0.0.0",
                   allow_insecure="true")  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_a_refused_connection_is_one_line(closed_port):
    for command in (("info",), ("score", '{"features": {}}')):
        done = run_cli(*command, port=str(closed_port))
        assert done.returncode == 1
        error = one_line_error(done, command[0])
        assert error.startswith(f"UNAVAILABLE: cannot reach 127.0.0.1:{closed_port}"), error


def test_info_says_why_a_model_is_not_ready(models_root):
    """The server answers but the model's serving version is not loaded: its reason, not
    'cannot reach'."""
    from liveserver import LiveServer

    with LiveServer(
        models_dir=models_root,
        default_model="credit-lite",
        pinned_versions={"credit-lite": "9"},
        budget_ms=5000,
    ) as server:
        done = run_cli("info", "--target", server.target)
    assert done.returncode == 1
    error = one_line_error(done, "info")
    assert error == (
        "UNAVAILABLE: model 'credit-lite': version '9' (pinned in the settings) is not loaded "
        "(server health: NOT_SERVING)"
    ), error


def test_bad_json_fields_and_types_are_one_line(live):
    for payload, named in (
        ({"features": {"amount": "lots"}}, "features"),
        ({"featurez": {}}, "featurez"),
        ({"history": [{"values": "x"}]}, "values"),
        ([1, 2], "requests"),
    ):
        done = run_cli("score", "--target", live.target, json.dumps(payload))
        assert done.returncode == 2, done.stderr
        error = one_line_error(done, "score")
        assert error.startswith("invalid request: ") and named in error, error
    done = run_cli("score", "--target", live.target, "{not json")
    assert one_line_error(done, "score").startswith("cannot read the request: ")
    done = run_cli("score", "--target", live.target, "-", stdin='"a string"')
    assert "JSON object" in one_line_error(done, "score")


def test_invalid_settings_are_one_line():
    done = run_cli("info", port="many")
    assert done.returncode == 2
    assert one_line_error(done, "info").startswith("invalid settings: port: ")
    done = run_cli("stats", metrics_port="none")
    assert "RISKSERVE_METRICS_PORT=none" in one_line_error(done, "stats")


def test_an_unknown_log_level_is_a_usage_error_not_a_traceback():
    done = run_cli("--log-level", "bogus", "info")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "argument --log-level: invalid choice: 'BOGUS'" in done.stderr.splitlines()[-1]
    assert run_cli("--log-level", "debug", "validate", "--help").returncode == 0


def test_stats_reports_an_unreachable_metrics_port(closed_port):
    done = run_cli("stats", "--window-s", "0", metrics_port=str(closed_port))
    assert done.returncode == 2
    error = one_line_error(done, "stats")
    assert error.startswith(f"cannot scrape http://127.0.0.1:{closed_port}/metrics: "), error


def test_clients_send_the_servers_token(models_root):
    from liveserver import LiveServer

    with LiveServer(
        models_dir=models_root, default_model="credit-lite", auth_token="s3cret", budget_ms=5000
    ) as server:
        port = str(server.port)
        assert run_cli("info", port=port, auth_token="s3cret").returncode == 0
        refused = run_cli("info", port=port)
        assert one_line_error(refused, "info").startswith("UNAUTHENTICATED: ")
        wrong = run_cli("info", "--token", "nope", port=port, auth_token="s3cret")
        assert one_line_error(wrong, "info").startswith("UNAUTHENTICATED: ")


def test_clients_talk_tls_when_the_server_has_a_certificate(models_root, tmp_path):
    from certs import Authority
    from liveserver import LiveServer

    ca = Authority()
    pair = ca.issue("riskserve", server=True)
    files = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    files["cert"].write_bytes(pair.cert_pem)
    files["key"].write_bytes(pair.key_pem)
    files["ca"].write_bytes(ca.pem)
    tls = {"tls_cert_file": str(files["cert"]), "tls_key_file": str(files["key"])}
    with LiveServer(
        models_dir=models_root, default_model="credit-lite", budget_ms=5000, **tls
    ) as server:
        port = str(server.port)
        done = run_cli("info", port=port, tls_ca_file=str(files["ca"]), **tls)
        assert done.returncode == 0, done.stderr
        done = run_cli("info", "--tls-ca", str(files["ca"]), port=port)
        assert done.returncode == 0, done.stderr
        # Without the CA the server's certificate is not trusted: refused, in one line.
        assert one_line_error(run_cli("info", port=port, **tls), "info").startswith("UNAVAILABLE")


@pytest.fixture()
def taken_port() -> Iterator[int]:
    """A loopback port something already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_serve_on_a_taken_port_says_which_in_one_line(taken_port, tmp_path):
    from modelkit import write_tabular_model

    write_tabular_model(tmp_path)
    common = {"models_dir": str(tmp_path), "trace_file": "none", "warmup_iterations": "0"}
    done = run_cli("serve", port="0", metrics_port=str(taken_port), **common)
    error = one_line_error(done, "serve")
    assert error.startswith(f"cannot serve metrics on 127.0.0.1:{taken_port}: "), error
    assert "RISKSERVE_METRICS_PORT" in error
    # The gRPC port is bound once the models are loaded: the server's log comes first, then
    # the one line of the error, and no traceback.
    done = run_cli("serve", port=str(taken_port), metrics_port="none", **common)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"riskserve serve: cannot listen on 127.0.0.1:{taken_port}: "), last


def test_serve_sets_the_thread_switch_interval(models_root):
    from liveserver import server_process

    output: list[str] = []
    settings = {"RISKSERVE_SWITCH_INTERVAL_US": "500", "RISKSERVE_DEFAULT_MODEL": "credit-lite"}
    with server_process(models_root, output=output, **settings):
        pass
    assert any("thread switch interval 500 µs" in line for line in output), "".join(output)
