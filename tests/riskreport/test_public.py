"""The report's public names, and how it is started: `riskserve shadow-report`, `-m riskreport`."""

from __future__ import annotations

import subprocess
import sys

from liveserver import REPO

import riskreport as report


def test_public_surface_is_exactly_all() -> None:
    public = {n for n in vars(report) if not n.startswith("_")}
    modules = {"build", "cli", "dataset", "html", "labels", "stats", "summary"}
    assert public - modules == set(report.__all__)
    assert all(getattr(report, name) is not None for name in report.__all__)


def run(*argv: str, blocked: str | None = None) -> subprocess.CompletedProcess[str]:
    """Python with `argv`; with `blocked`, as if that module were not installed."""
    code = "import runpy, sys\n"
    if blocked:
        code += f"sys.modules[{blocked!r}] = None\n"  # an import of it fails as when missing
    code += "sys.argv = sys.argv[1:]\nrunpy.run_module(sys.argv[0], run_name='__main__')\n"
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_both_commands_take_the_reports_options() -> None:
    for argv, prog in (
        (("service", "shadow-report", "--help"), "riskserve shadow-report"),
        (("riskreport", "--help"), "python -m riskreport"),
    ):
        done = run(*argv)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: {prog} ")
        assert "--labels LABELS" in done.stdout and "--memory-limit" in done.stdout


def test_the_command_reports_errors_of_its_options_as_before() -> None:
    done = run("service", "shadow-report", "--bootstrap", "many")
    assert done.returncode == 2
    assert "riskserve shadow-report: error: argument --bootstrap" in done.stderr
    done = run("service", "info", "--labels", "x")  # other commands still refuse what is unknown
    assert done.returncode == 2 and "unrecognized arguments: --labels x" in done.stderr


def test_without_the_report_extra_the_command_says_how_to_install_it() -> None:
    done = run("service", "shadow-report", "--prefix", "logs", blocked="duckdb")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        "riskserve shadow-report: needs the report extra (duckdb is not installed): "
        "pip install 'riskserve[report]'\n"
    )
