"""The Open Inference Protocol, exercised by NVIDIA's own Python client."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from demo.generator import generate, model_inputs


def test_tritonclient_calls_every_oip_rpc(live, models_root, tmp_path):
    data = generate(16, seed=4242)
    arrays = model_inputs(data)
    npz = tmp_path / "inputs.npz"
    np.savez(npz, **arrays)
    client = Path(__file__).with_name("oip_client.py")
    run = subprocess.run(
        [sys.executable, str(client), live.target, "fraud-demo", str(npz)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["live"] and got["ready"] and got["model_ready"]
    assert got["unknown_model_ready"] is False
    assert got["server"]["name"] == "riskserve"
    assert got["metadata"]["name"] == "fraud-demo"
    assert [t["name"] for t in got["metadata"]["inputs"]] == ["features", "history", "history_mask"]
    assert got["config"]["config"]["max_batch_size"] > 1
    assert got["missing_status"] == "StatusCode.NOT_FOUND"
    session = ort.InferenceSession(
        str(models_root / "fraud-demo" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    expected = session.run(["score"], arrays)[0].reshape(-1)
    np.testing.assert_allclose(np.array(got["scores"]), expected, atol=1e-6)
