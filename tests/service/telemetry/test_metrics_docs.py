"""docs/telemetry.md's metric table is written from the instruments the code creates."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

from liveserver import REPO, LiveServer
from modelkit import sequence_request, write_sequence_model
from prometheus_client.parser import text_string_to_metric_families

from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc
from service.telemetry.docs import instruments, render
from service.telemetry.metrics import ATTRIBUTES

PAGE = REPO / "docs" / "telemetry.md"
_SERIES_SUFFIXES = re.compile(r"_(bucket|sum|count|created)$")


def test_the_metric_table_is_current():
    assert render(PAGE.read_text()) == PAGE.read_text(), "run python -m service.telemetry.docs"


def test_every_instrument_has_its_attributes_and_a_description():
    made = instruments()
    assert {i.name for i in made} == set(ATTRIBUTES)
    assert all(i.description for i in made)
    assert len({i.prometheus for i in made}) == len(made)


def test_a_live_server_exports_no_metric_the_table_leaves_out(tmp_path):
    models = tmp_path / "models"
    write_sequence_model(models)
    with LiveServer(models_dir=models, default_model="seq-mini", metrics_port=0) as live:
        with live.channel() as channel:
            pb_grpc.RiskScoringStub(channel).Score(sequence_request(1, 4), timeout=5)
        with urllib.request.urlopen(live.server.telemetry.metrics_url, timeout=5) as response:
            text = response.read().decode()
    documented = {i.prometheus for i in instruments()}
    exported = {
        _SERIES_SUFFIXES.sub("", sample.name)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("riskserve_")
    }
    assert "riskserve_request_duration_seconds" in exported
    assert exported <= documented


def test_check_mode_fails_on_a_stale_page(tmp_path):
    stale = tmp_path / "telemetry.md"
    stale.write_text(PAGE.read_text().replace("riskserve_shed_total", "riskserve_shedded_total"))
    command = [sys.executable, "-m", "service.telemetry.docs", "--check", "--path", str(stale)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "stale" in done.stderr
    subprocess.run([*command[:-3], "--path", str(stale)], check=True, capture_output=True)
    assert stale.read_text() == PAGE.read_text()
