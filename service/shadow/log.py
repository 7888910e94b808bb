"""`ExperimentLog`: buffer experiment records in memory, write Parquet files in the background.

Layout under the prefix::

    <prefix>/<experiment>/<replica_id>/part-<utc-ns>-<seq>.parquet

Each flush writes new complete files, so several replicas share one prefix without clashing,
a killed process loses at most what it buffered since its last flush, and files already
written stay readable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pyarrow.fs as pafs

from service.shadow.record import ExperimentRecord, records_to_table
from service.shadow.storage import (
    default_replica_id,
    resolve_prefix,
    safe_segment,
    write_table_atomically,
)

__all__ = ["ExperimentLog"]

_log = logging.getLogger(__name__)


class ExperimentLog:
    """Thread-safe, never-blocking sink of experiment records.

    `log` only appends to a bounded list under a lock; a daemon thread swaps the list out
    every `flush_interval_s` and writes it. When the buffer holds `max_buffered_records`, new
    records are dropped and counted (and `on_drop(n)` is called, e.g. to bump a metric).
    """

    def __init__(
        self,
        prefix: str,
        *,
        replica_id: str | None = None,
        flush_interval_s: float = 1.0,
        max_buffered_records: int = 100_000,
        filesystem: pafs.FileSystem | None = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        if flush_interval_s <= 0 or max_buffered_records <= 0:
            raise ValueError("flush_interval_s and max_buffered_records must be positive")
        self._fs, self._root = resolve_prefix(prefix, filesystem)
        self.replica_id = safe_segment(replica_id) if replica_id else default_replica_id()
        self.flush_interval_s = flush_interval_s
        self.max_buffered_records = max_buffered_records
        self._on_drop = on_drop
        self._buffer: list[tuple[ExperimentRecord, int]] = []  # (record, UTC time in ns)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._sequence = 0
        self.dropped = 0
        self.written = 0
        self.files_written = 0
        self.write_errors = 0

    def start(self) -> ExperimentLog:
        """Start the background flusher (idempotent); returns self for chaining."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"experiment-log-{self.replica_id}", daemon=True
            )
            self._thread.start()
        return self

    def log(self, record: ExperimentRecord) -> bool:
        """Queue one record; False (and counted) when the buffer is full or the log is closed."""
        with self._lock:
            if not self._closed and len(self._buffer) < self.max_buffered_records:
                self._buffer.append((record, record.time_ns or time.time_ns()))
                return True
            self.dropped += 1
        if self._on_drop is not None:
            self._on_drop(1)
        return False

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def flush(self) -> int:
        """Write everything buffered now, one file per experiment; returns records written."""
        with self._write_lock:
            with self._lock:
                batch, self._buffer = self._buffer, []
            if not batch:
                return 0
            written = 0
            for experiment, records in _by_experiment(batch).items():
                written += self._write(experiment, records)
            return written

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new records, stop the flusher and write what is left (call on SIGTERM).

        Blocking: from an event loop, call it through ``asyncio.to_thread``.
        """
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.flush()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_interval_s)
            if self._closed:
                return  # close() does the last flush itself, after join
            try:
                self.flush()
            except Exception:  # the flusher must survive anything a filesystem raises
                _log.exception("experiment log flush failed")

    def _write(self, experiment: str, records: list[tuple[ExperimentRecord, int]]) -> int:
        self._sequence += 1
        path = (
            f"{self._root}/{safe_segment(experiment)}/{self.replica_id}/"
            f"part-{time.time_ns():020d}-{self._sequence:06d}.parquet"
        )
        try:
            write_table_atomically(records_to_table(records, self.replica_id), self._fs, path)
        except OSError:
            self.write_errors += 1
            self._requeue_or_drop(records)
            _log.exception("writing %d experiment records failed", len(records))
            return 0
        self.written += len(records)
        self.files_written += 1
        return len(records)

    def _requeue_or_drop(self, records: list[tuple[ExperimentRecord, int]]) -> None:
        # Keep failed records for the next flush while they fit in the bound; drop the rest.
        with self._lock:
            room = max(0, self.max_buffered_records - len(self._buffer))
            kept = records[:room] if not self._closed else []
            self._buffer[:0] = kept
            lost = len(records) - len(kept)
            self.dropped += lost
        if lost and self._on_drop is not None:
            self._on_drop(lost)


def _by_experiment(
    records: list[tuple[ExperimentRecord, int]],
) -> dict[str, list[tuple[ExperimentRecord, int]]]:
    groups: dict[str, list[tuple[ExperimentRecord, int]]] = {}
    for item in records:
        groups.setdefault(item[0].experiment, []).append(item)
    return groups
