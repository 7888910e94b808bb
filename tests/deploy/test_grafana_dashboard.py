"""The Grafana dashboard queries only what a real riskserve exports on /metrics, and what a
real HAProxy front exports on its own."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
from fakes import fake_factory
from liveserver import LiveServer
from modelkit import write_sequence_model
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until

from bench.servers import free_port
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.config import Settings
from service.front import find_haproxy, write

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "riskserve.json"
METRIC = re.compile(r"\briskserve_[a-z0-9_]+")
FRONT_METRIC = re.compile(r"\bhaproxy_[a-z0-9_]+")
GROUPING = re.compile(r"\bby \(([^)]*)\)")
MATCHER = re.compile(r"([a-z_]+)\s*(?:=~|!~|!=|=)\s*\"")


def _queries(dashboard: dict) -> list[str]:
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [
        v["definition"] for v in dashboard["templating"]["list"] if v.get("type") == "query"
    ]
    return queries


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    """Sample name -> its label names, scraped from a server that has scored a request."""
    models = tmp_path_factory.mktemp("dashboard-models")
    write_sequence_model(models)
    factory, _ = fake_factory()
    with LiveServer(
        engine_factory=factory,
        models_dir=models,
        default_model="seq-mini",
        budget_ms=2000,
        warmup_iterations=0,
        metrics_port=0,
    ) as server:
        with server.channel() as channel:
            pb_grpc.RiskScoringStub(channel).Score(
                pb.ScoreRequest(
                    features={f"x{j}": 0.0 for j in range(4)},
                    history=[pb.HistoryRow(values=[0.1, 0.2, 0.3])],
                ),
                timeout=5,
            )
        url = server.server.telemetry.metrics_url
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    return _samples(text)


def _samples(text: str) -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


@pytest.fixture(scope="module")
def front_exported(tmp_path_factory) -> dict[str, set[str]]:
    """Sample name -> its label names, scraped from HAProxy's exporter running the front's
    configuration over two workers (which need not be up for the series to exist)."""
    haproxy = find_haproxy()
    if haproxy is None:
        pytest.skip("no haproxy here: `make test` installs Debian's haproxy where it runs as root")
    port = free_port()
    config = write(
        tmp_path_factory.mktemp("front"), Settings(port=free_port()),
        ["127.0.0.1:1", "127.0.0.1:2"], metrics_port=port,
    )  # fmt: skip
    front = subprocess.Popen(
        [haproxy, "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    texts: list[str] = []

    def scraped() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                texts.append(reply.read().decode())
        except OSError:
            return front.poll() is not None
        return True

    try:
        wait_until(scraped, timeout_s=30)
    finally:
        front.terminate()
        front.wait(timeout=10)
    assert texts, f"haproxy exited with status {front.returncode}"
    return _samples(texts[-1])


def _check_queries(pattern: re.Pattern[str], exported: dict[str, set[str]]) -> int:
    """Check each query naming metrics that match `pattern`; how many there were."""
    checked = 0
    for query in _queries(json.loads(DASHBOARD.read_text())):
        metrics = pattern.findall(query)
        if not metrics:
            continue
        checked += 1
        missing = [m for m in metrics if m not in exported]
        assert not missing, f"{query}: {missing} not on /metrics"
        labels = set().union(*(exported[m] for m in metrics))
        used = {label.strip() for group in GROUPING.findall(query) for label in group.split(",")}
        used |= set(MATCHER.findall(query))
        assert used <= labels, f"{query}: labels {used - labels} not on {metrics}"
    return checked


def test_every_query_names_exported_metrics_and_labels(exported):
    queries = _queries(json.loads(DASHBOARD.read_text()))
    for query in queries:
        assert METRIC.search(query) or FRONT_METRIC.search(query), query
    assert _check_queries(METRIC, exported) > 0


def test_every_front_query_names_the_front_s_metrics_and_labels(front_exported):
    assert _check_queries(FRONT_METRIC, front_exported) > 0


def test_the_dashboard_covers_what_an_operator_watches():
    dashboard = json.loads(DASHBOARD.read_text())
    queries = "\n".join(_queries(dashboard))
    for needed in (
        "histogram_quantile(0.5, sum by (method, le) (rate(riskserve_request_duration_seconds",
        "histogram_quantile(0.99, sum by (method, le) (rate(riskserve_request_duration_seconds",
        "sum by (method) (rate(riskserve_requests_total",
        "sum by (reason) (rate(riskserve_shed_total",
        "riskserve_queue_depth",
        "riskserve_batch_size_bucket",
        "sum by (engine) (rate(riskserve_requests_total",
        "sum by (reason) (rate(riskserve_fallbacks_total",
        "riskserve_shadow_drops_total",
        'rate(haproxy_backend_http_responses_total{proxy="calls", code="5xx"}',
        'haproxy_backend_current_queue{proxy="calls"}',
    ):
        assert needed in queries, needed
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
