"""docs/configuration.md is generated from the Settings model and must be current."""

from __future__ import annotations

import subprocess
import sys

from liveserver import REPO

from service.config import Settings
from service.config_docs import render

PAGE = REPO / "docs" / "configuration.md"


def test_configuration_page_is_current():
    assert PAGE.read_text() == render(), "stale: run python -m service.config_docs"


def test_every_setting_has_a_row_with_its_variable_and_description():
    page = render()
    for name, field in Settings.model_fields.items():
        assert f"| `{name}` | `RISKSERVE_{name.upper()}` |" in page
        assert field.description, f"{name} has no description"


def test_check_mode_fails_on_a_stale_page(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(render().replace("RISKSERVE_PORT", "RISKSERVE_PROT"))
    command = [sys.executable, "-m", "service.config_docs", "--check", "--path", str(stale)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "stale" in done.stderr
    rewrite = [sys.executable, "-m", "service.config_docs", "--path", str(stale)]
    subprocess.run(rewrite, check=True, timeout=60, capture_output=True)
    assert subprocess.run(command, timeout=60, check=False).returncode == 0
