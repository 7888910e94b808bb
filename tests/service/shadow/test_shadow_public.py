from __future__ import annotations

import subprocess
import sys

import service.shadow as shadow
import service.shadow.report as report


def test_public_surface_is_exactly_all() -> None:
    public = {name for name in vars(shadow) if not name.startswith("_")}
    modules = {"channel", "errors", "experiment", "job", "log", "priority", "record", "report",
               "runner", "scorer", "storage", "worker", "Any"}  # fmt: skip
    # The report's names load on first use; the rest are there from the start.
    assert public - modules <= set(shadow.__all__)
    assert all(getattr(shadow, name) is not None for name in shadow.__all__)
    report_public = {n for n in vars(report) if not n.startswith("_")}
    report_modules = {"build", "cli", "dataset", "html", "labels", "stats", "summary"}
    assert report_public - report_modules == set(report.__all__)


def test_the_server_never_imports_the_report() -> None:
    """Serving routes, scores and logs: DuckDB, SciPy, Matplotlib and the report stay out."""
    heavy = ("duckdb", "scipy", "matplotlib", "service.shadow.report")
    code = (
        "import sys, service.server, service.models.experiments, service.shadow.worker\n"
        f"print([m for m in sys.modules if m.split('.')[0] in {heavy!r} or m in {heavy!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
