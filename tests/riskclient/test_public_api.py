"""The client's public surface is curated, and it imports without the server or a model runtime."""

from __future__ import annotations

import subprocess
import sys

import riskclient

EXPECTED = {
    "AdaptiveThrottle",
    "AsyncRiskClient",
    "AsyncScoreStream",
    "Connection",
    "Decision",
    "HistoryRow",
    "RequestLike",
    "RiskClient",
    "RiskClientError",
    "ScoreBatchRequest",
    "ScoreRequest",
    "ScoreResponse",
    "ScoreStream",
    "ScoringError",
    "StreamClosed",
}


def test_all_is_the_curated_surface():
    assert set(riskclient.__all__) == EXPECTED
    assert sorted(riskclient.__all__) == riskclient.__all__
    public = {n for n in vars(riskclient) if not n.startswith("_")}
    assert public - EXPECTED == set(), "public names outside __all__"
    for name in riskclient.__all__:
        assert getattr(riskclient, name) is not None


def test_imports_without_onnxruntime_or_the_server():
    # onnxruntime and the server's packages made unimportable: the client must not need them.
    code = (
        "import sys\n"
        "for name in ('onnxruntime', 'service', 'engines', 'numpy'):\n"
        "    sys.modules[name] = None\n"
        "import riskclient\n"
        "client = riskclient.RiskClient('127.0.0.1:1')\n"
        "client.close()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('onnxruntime', 'service', 'engines', 'numpy') and sys.modules[m] is not None))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
