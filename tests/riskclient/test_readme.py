"""The README's Python example, run as it is written: with only RISKSERVE_PORT exported it
reaches a server on that port and prints decisions by name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from liveserver import REPO

from demo.sample_request import sample_request
from riskclient import Decision

DECISIONS = set(Decision.keys())


def readme_python_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Calling riskserve from Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "the README's Python section has no python code block"
    return match.group(1)


def test_readme_example_finds_the_server_from_riskserve_port(live, tmp_path):
    (tmp_path / "request.json").write_text(json.dumps(sample_request()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RISKSERVE_")}
    env["RISKSERVE_PORT"] = str(live.port)  # what the README says to export; not 50051
    done = subprocess.run(
        [sys.executable, "-c", readme_python_example()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    first, *streamed = done.stdout.splitlines()
    score, decision, engine = first.split()
    assert 0.0 <= float(score) <= 1.0
    assert decision in DECISIONS, first
    assert engine == "onnxruntime-cpu"
    assert len(streamed) == 100
    # A stream answer is `txn-i DECISION`; a failed one starts with its status code's name.
    answered = [line.split() for line in streamed if line.startswith("txn-")]
    assert answered
    assert all(words[1] in DECISIONS for words in answered), answered
    assert all(line.split()[0].isupper() for line in streamed if not line.startswith("txn-"))
