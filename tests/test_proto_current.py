"""The committed generated protobuf modules match what the .proto files generate now."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GENERATED = sorted(
    p.relative_to(REPO / "proto")
    for p in (REPO / "proto").rglob("*")
    if p.suffix in (".py", ".pyi") and p.name != "__init__.py"
)


def test_generated_code_is_current(tmp_path):
    out = tmp_path / "gen"
    out.mkdir()
    protos = [str(p.relative_to(REPO / "proto")) for p in (REPO / "proto").rglob("*.proto")]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{REPO / 'proto'}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *protos,
        ],
        check=True,
    )
    fresh = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert fresh == GENERATED
    for rel in GENERATED:
        assert (out / rel).read_text() == (REPO / "proto" / rel).read_text(), (
            f"proto/{rel} is stale: run `make proto`"
        )
    shutil.rmtree(out)
