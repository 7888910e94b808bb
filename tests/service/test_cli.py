"""`riskserve score` and `riskserve info` against a live server: JSON in, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys

from demo.generator import FEATURE_NAMES, HISTORY_FIELDS, generate


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_score_one_request_from_stdin(live):
    data = generate(1, seed=77)
    request = {
        "requestId": "cli-1",
        "entityId": data.entity_ids[0],
        "features": dict(zip(FEATURE_NAMES, data.features[0].tolist(), strict=True)),
        "history": [{"values": row.tolist()} for row in data.histories[0]],
    }
    done = run_cli("score", "--target", live.target, "-", stdin=json.dumps(request))
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["requestId"] == "cli-1"
    assert reply["decision"] in ("APPROVE", "REVIEW", "DECLINE")
    assert reply["engine"] == "onnxruntime-cpu"


def test_score_batch_and_error_status(live):
    items = [
        {
            "requestId": f"b{i}",
            "model": "credit-lite",
            "features": {f"f{j}": float(i + j) for j in range(5)},
        }
        for i in range(3)
    ]
    done = run_cli(
        "score", "--target", live.target, json.dumps({"model": "credit-lite", "requests": items})
    )
    assert done.returncode == 0, done.stderr
    assert [r["requestId"] for r in json.loads(done.stdout)["responses"]] == ["b0", "b1", "b2"]
    bad = run_cli("score", "--target", live.target, json.dumps({"features": {"nope": 1}}))
    assert bad.returncode == 1
    error = json.loads(bad.stderr.strip().splitlines()[-1])
    assert error["code"] == "INVALID_ARGUMENT" and "nope" in error["message"]


def test_info_prints_schema(live):
    done = run_cli("info", "--target", live.target, "--model", "fraud-demo")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["historyFields"] == list(HISTORY_FIELDS)


def test_readme_quick_start_request(live, tmp_path):
    """The README's quick start: a sample request from the demo, scored by the CLI."""
    sample = subprocess.run(
        [sys.executable, "-m", "demo.sample_request"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    path = tmp_path / "request.json"
    path.write_text(sample.stdout)
    done = run_cli("score", "--target", live.target, str(path))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requestId"] == "demo-0"
