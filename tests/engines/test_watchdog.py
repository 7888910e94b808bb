"""The watchdog's threads end with the engine it wraps: a retired model version (each hot
reload retires one) left them waiting for calls for the life of the process."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fakes import FakeEngine
from modelkit import write_sequence_model
from waiting import wait_until

from engines.base import EngineUnavailable
from engines.manifest import load_manifest
from engines.watchdog import Watchdog


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"watchdog-{name}-")]


def test_closing_a_watched_engine_ends_its_threads_and_refuses_later_calls(tmp_path):
    manifest = load_manifest(write_sequence_model(tmp_path))
    engine = Watchdog(FakeEngine(manifest, name="retired", concurrency=2), timeout_s=5.0)
    rows = {
        "features": np.zeros((1, 4), np.float32),
        "history": np.zeros((1, 2, 3), np.float32),
        "history_mask": np.ones((1, 2), np.float32),
    }
    calls = [threading.Thread(target=engine.infer, args=(rows,)) for _ in range(3)]
    for call in calls:
        call.start()
    for call in calls:
        call.join()
    assert _threads("retired")
    engine.close()
    wait_until(lambda: not _threads("retired"))
    with pytest.raises(EngineUnavailable, match="closed"):
        engine.infer(rows)
