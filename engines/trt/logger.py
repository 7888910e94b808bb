"""A `trt.ILogger` that forwards TensorRT's messages into Python logging and keeps the last few.

TensorRT reports build and runtime errors only through its logger (a failed build returns None),
so the engine code reads `recent_errors()` to say why.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

__all__ = ["make_logger"]

_cache: dict[int, type] = {}


def _logger_class(trt: Any) -> type:
    cls = _cache.get(id(trt))
    if cls is not None:
        return cls
    sev = trt.ILogger.Severity
    levels = {
        sev.INTERNAL_ERROR: logging.CRITICAL,
        sev.ERROR: logging.ERROR,
        sev.WARNING: logging.WARNING,
        sev.INFO: logging.INFO,
        sev.VERBOSE: logging.DEBUG,
    }

    class LoggingLogger(trt.ILogger):  # type: ignore[misc, name-defined]
        """Thread-safe: TensorRT may call `log` from its own threads."""

        def __init__(self, name: str, keep: int) -> None:
            trt.ILogger.__init__(self)
            self._log = logging.getLogger(name)
            self._lock = threading.Lock()
            self._errors: deque[str] = deque(maxlen=keep)

        def log(self, severity: Any, msg: str) -> None:
            level = levels.get(severity, logging.INFO)
            if level >= logging.ERROR:
                with self._lock:
                    self._errors.append(msg)
            self._log.log(level, "%s", msg)

        def recent_errors(self) -> list[str]:
            with self._lock:
                return list(self._errors)

        def clear(self) -> None:
            with self._lock:
                self._errors.clear()

    _cache[id(trt)] = LoggingLogger
    return LoggingLogger


def make_logger(trt: Any, name: str = "engines.trt", keep: int = 32) -> Any:
    """A new logger for the given `tensorrt` module; keeps the last `keep` error messages."""
    return _logger_class(trt)(name, keep)
