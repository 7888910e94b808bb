"""A model file that does not load, replaced in place, is logged once per change: one ERROR
line naming the folder and the reason, the traceback at DEBUG only."""

from __future__ import annotations

import logging

from liveserver import LiveServer
from modelkit import write_tabular_model
from waiting import wait_until

LOGGER = "service.models.reload"


def refusals(caplog, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_a_corrupt_model_file_is_one_line_per_change(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    served_dir = write_tabular_model(tmp_path / "models", version="1", seed=0)
    server = LiveServer(
        models_dir=tmp_path / "models",
        default_model="credit-lite",
        reload_interval_s=0.1,
        budget_ms=3000,
        onnx_variants=False,
        tensorrt=False,
    )
    with server:
        watcher = server.server.watcher
        assert watcher is not None
        (served_dir / "model.onnx").write_bytes(b"not an onnx model")
        wait_until(lambda: watcher.refused == 1)
        for _ in range(3):  # later scans see the same files: no new attempt, no new line
            server.call(watcher.scan())
        assert len(refusals(caplog, logging.ERROR)) == 1
        (served_dir / "model.onnx").write_bytes(b"still not an onnx model")
        wait_until(lambda: watcher.refused == 2)
    errors = refusals(caplog, logging.ERROR)
    assert len(errors) == 2
    for record in errors:
        line = record.getMessage()
        assert record.exc_info is None and "\n" not in line, line
        assert str(served_dir) in line and "do not load" in line
        assert "onnx.ModelProto" in line, line  # the reason: the file does not parse
    debug = [r for r in refusals(caplog, logging.DEBUG) if r.exc_info is not None]
    assert len(debug) == 2
