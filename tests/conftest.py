from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

from liveserver import REPO, LiveServer
from modelkit import write_sequence_model, write_tabular_model

DEMO = REPO / "models" / "fraud-demo"


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model beside two differently shaped test models."""
    root = tmp_path_factory.mktemp("models")
    (root / "fraud-demo").symlink_to(DEMO, target_is_directory=True)
    write_tabular_model(root)
    write_sequence_model(root)
    return root


@pytest.fixture(scope="session")
def live(models_root: Path) -> Iterator[LiveServer]:
    """One server for the read-only API tests of the session."""
    # Correctness tests: a generous budget, so a loaded CI machine does not shed them, and
    # FP32 only, so scores compare exactly with ONNX Runtime run directly.
    with LiveServer(
        models_dir=models_root,
        max_batch_size=32,
        budget_ms=5000,
        onnx_variants=False,
        reflection=True,
    ) as server:
        yield server
