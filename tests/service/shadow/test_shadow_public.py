"""The serving side of shadow evaluation: its public names, and the report kept out of it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from liveserver import REPO, server_process
from modelkit import write_sequence_model
from waiting import wait_until

import service.shadow as shadow

# The report package and the libraries only it uses.
HEAVY = ("riskreport", "duckdb", "scipy", "matplotlib")

# `riskserve serve` in this process, as the console script runs it. Once the test has seen the
# server answer SERVING it creates FLAG; then the modules loaded by now are written to OUT.
SERVE_AND_LIST_MODULES = """
import json, os, sys, threading, time
from pathlib import Path

flag, out = Path(sys.argv[1]), Path(sys.argv[2])

def list_modules():
    while not flag.exists():
        time.sleep(0.02)
    names = sorted(sys.modules.copy())
    out.with_suffix(".tmp").write_text(json.dumps(names))
    os.replace(out.with_suffix(".tmp"), out)

threading.Thread(target=list_modules, daemon=True).start()
from service.cli import main
sys.exit(main(["serve"]))
"""


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in HEAVY]


def test_public_surface_is_exactly_all() -> None:
    public = {name for name in vars(shadow) if not name.startswith("_")}
    modules = {"channel", "errors", "experiment", "job", "log", "priority", "record", "runner",
               "scorer", "storage", "worker"}  # fmt: skip
    assert public - modules == set(shadow.__all__)
    assert all(getattr(shadow, name) is not None for name in shadow.__all__)


def test_the_serving_modules_never_import_the_report() -> None:
    """Serving routes, scores and logs: DuckDB, SciPy, Matplotlib and the report stay out."""
    code = (
        "import sys, service.server, service.models.experiments, service.shadow.worker\n"
        "import service.cli\n"
        "service.cli._parser()\n"
        "print([m for m in sys.modules if m.split('.')[0] in sys.argv[1:]])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *HEAVY], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_a_running_server_has_not_imported_the_report(tmp_path: Path) -> None:
    """`riskserve serve` with a shadow experiment, once SERVING: no report module loaded."""
    models = tmp_path / "models"
    write_sequence_model(models, version="1", seed=1)
    write_sequence_model(models, version="2", seed=2)
    config = tmp_path / "experiments.json"
    experiment = {"champion": "1", "challengers": ["2"], "mode": "shadow"}
    config.write_text(json.dumps({"models": {"seq-mini": experiment}}))
    flag, out = tmp_path / "serving", tmp_path / "modules.json"
    env = {
        "RISKSERVE_EXPERIMENTS_FILE": str(config),
        "RISKSERVE_SHADOW_LOG_PREFIX": str(tmp_path / "logs"),
        "RISKSERVE_DEFAULT_MODEL": "seq-mini",
    }
    argv = ("-c", SERVE_AND_LIST_MODULES, str(flag), str(out))
    with server_process(models, argv, **env) as (_, target), grpc.insecure_channel(target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        serving = health_pb2.HealthCheckResponse.SERVING
        wait_until(lambda: _status(health) == serving, timeout_s=60)
        flag.touch()
        wait_until(out.exists, timeout_s=30)
    modules = json.loads(out.read_text())
    assert "service.server" in modules and "service.shadow.runner" in modules  # it did serve
    assert heavy(modules) == []


def _status(health: health_pb2_grpc.HealthStub) -> int:
    try:
        return health.Check(health_pb2.HealthCheckRequest(), timeout=2).status  # type: ignore[no-any-return]
    except grpc.RpcError:
        return health_pb2.HealthCheckResponse.UNKNOWN


def test_only_the_shadow_report_command_imports_riskreport() -> None:
    """The dependency runs one way (riskreport reads service.shadow's records), except for the
    `riskserve shadow-report` dispatch, which imports it when that command runs."""
    found = []
    for path in sorted((REPO / "service").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        within: dict[int, str] = {}  # node -> the innermost function holding it
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                within.update((id(node), function.name) for node in ast.walk(function))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            if any(name.split(".")[0] in HEAVY for name in names):
                found.append((str(path.relative_to(REPO)), within.get(id(node), "<module>")))
    assert found == [("service/cli.py", "_shadow_report")]
