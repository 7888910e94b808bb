"""The Makefile leaves settings to the server: exported RISKSERVE_* reach `make serve` and
`make loadtest` unchanged (checked with make's dry run, which prints the commands)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def dry_run(*args: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("RISKSERVE_", "LOADTEST_"))}
    environ.pop("HOST", None)
    environ.pop("PORT", None)
    done = subprocess.run(
        ["make", "-n", *args],
        cwd=REPO,
        env=environ | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return " ".join(done.stdout.replace("\\\n", " ").split())


def test_serve_passes_no_port_so_the_servers_settings_decide():
    command = dry_run("serve", RISKSERVE_PORT="6051", HOST="myhost.example", PORT="1")
    assert "riskserve serve" in command
    # Neither the exported setting nor a shell's own HOST/PORT is turned into a flag.
    assert "--port" not in command and "--host" not in command


def test_serve_host_and_port_on_the_command_line_override():
    command = dry_run("serve", "HOST=0.0.0.0", "PORT=6052")
    assert "riskserve serve --host 0.0.0.0 --port 6052" in command


def test_loadtest_targets_the_exported_port_and_its_server_has_no_metrics_port():
    command = dry_run("loadtest", RISKSERVE_PORT="6053", RISKSERVE_METRICS_PORT="6464")
    assert "--target 127.0.0.1:6053" in command
    assert (
        "env RISKSERVE_METRICS_PORT=none RISKSERVE_FRONT=auto .venv/bin/riskserve serve "
        "--port 6053" in command
    )
    assert '--server ""' in dry_run("loadtest", "LOADTEST_SERVER=")
    assert "RISKSERVE_FRONT=none" in dry_run("loadtest", RISKSERVE_FRONT="none")


def test_serve_runs_the_front_where_haproxy_is_and_the_setting_leaves_it_to_make():
    assert "RISKSERVE_FRONT=${RISKSERVE_FRONT:-auto}" in dry_run("serve")


def test_the_server_installs_without_the_report_extra_and_the_tests_with_it():
    serve = dry_run("-B", "serve")  # -B: every install step, as on a fresh clone
    assert "-e '.[cpu]'" in serve and "report" not in serve
    assert "-e '.[cpu,test,report]'" in dry_run("-B", "test")
