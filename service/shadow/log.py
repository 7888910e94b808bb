"""`ExperimentLog`: buffer experiment records in memory, roll them into Hive-partitioned Parquet.

Layout under the prefix (plain Hive partitioning, readable by any Parquet engine)::

    <prefix>/date=<YYYY-MM-DD>/model=<model>/part-<replica_id>-<utc-ns>-<seq>.parquet

Every `flush_interval_s` the buffered records are appended, as one Arrow batch, to the open
file of their partition: an Arrow IPC stream in a spool folder, locked by its writer and
flushed to the operating system. A file is rolled (converted to Parquet with large row groups
and moved into place whole) once its spool holds `max_file_bytes` or is `max_file_age_s` old,
and on `close`. A process killed with SIGKILL loses only the records it had not yet appended;
the next `ExperimentLog` on the same spool folder finds the unlocked spool and publishes its
complete batches. Readers never see a partial file: Parquet files appear by rename (locally)
or when their upload completes (object stores), and spools end in ``.arrows``, inside a folder
named with a leading underscore, which dataset readers skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from service.shadow.record import RECORD_SCHEMA, ExperimentRecord, conform, records_to_table
from service.shadow.storage import (
    default_replica_id,
    resolve_prefix,
    safe_segment,
    write_table_atomically,
)

__all__ = [
    "DEFAULT_FLUSH_INTERVAL_S",
    "DEFAULT_MAX_FILE_AGE_S",
    "DEFAULT_MAX_FILE_BYTES",
    "ExperimentLog",
    "PartitionWriter",
    "Unappended",
]

DEFAULT_FLUSH_INTERVAL_S = 0.2
DEFAULT_MAX_FILE_BYTES = 128 * 2**20
DEFAULT_MAX_FILE_AGE_S = 300.0
ROW_GROUP_ROWS = 1_000_000
SPOOL_SUFFIX = ".arrows"

_log = logging.getLogger(__name__)


class _Spool:
    """One open file: an Arrow IPC stream under an exclusive lock, with its final name."""

    def __init__(self, path: Path, relative: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.relative = path, relative
        self.opened_s = time.monotonic()
        # Locked under a name recovery does not look for, then renamed: a recovering process
        # never sees this spool unlocked while its writer lives.
        fresh = path.with_name(f"{path.name}.new")
        self._file = open(fresh, "wb")  # noqa: SIM115 - held open until the file rolls
        fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fresh.rename(path)
        self._writer = pa.ipc.new_stream(self._file, RECORD_SCHEMA)
        self.rows = 0

    def append(self, table: pa.Table) -> None:
        self._writer.write_table(table, max_chunksize=len(table) or None)
        self._file.flush()  # in the kernel's hands now: a killed process does not lose it
        self.rows += len(table)

    @property
    def bytes(self) -> int:
        return self._file.tell()

    def end_stream(self) -> None:
        with contextlib.suppress(OSError, pa.ArrowException):
            self._writer.close()

    def release(self) -> None:
        self._file.close()


class Unappended(OSError):
    """Appending to the open files failed; `rows` (of the table given) reached none of them."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"{len(rows)} experiment records reached no open file")
        self.rows = rows


def read_spool(path: Path) -> pa.Table:
    """The complete batches of a spool; a batch cut short by a kill is left out."""
    batches: list[pa.RecordBatch] = []
    try:
        with pa.ipc.open_stream(pa.memory_map(str(path))) as reader:
            for batch in reader:
                batches.append(batch)
    except (pa.ArrowInvalid, OSError, EOFError):
        pass  # a truncated tail: everything before it is whole
    if batches and batches[0].schema != RECORD_SCHEMA:  # spooled by an older release
        return conform(pa.Table.from_batches(batches))
    return pa.Table.from_batches(batches, RECORD_SCHEMA)


class PartitionWriter:
    """Appends tables to one open file per (date, model) partition and rolls them into place.

    Not thread-safe: `ExperimentLog` serializes calls; a bulk writer (a benchmark's generator,
    a backfill) may use one directly.
    """

    def __init__(
        self,
        fs: pafs.FileSystem,
        root: str,
        spool_dir: Path,
        replica_id: str,
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_file_age_s: float = DEFAULT_MAX_FILE_AGE_S,
    ) -> None:
        if max_file_bytes <= 0 or max_file_age_s <= 0:
            raise ValueError("max_file_bytes and max_file_age_s must be positive")
        self._fs, self._root, self._spool_dir = fs, root, spool_dir
        self.replica_id = replica_id
        self.max_file_bytes, self.max_file_age_s = max_file_bytes, max_file_age_s
        self._open: dict[tuple[str, str], _Spool] = {}
        self._sequence = 0
        self.files_written = 0
        self.rows_published = 0

    def append(self, table: pa.Table) -> None:
        """Append `table` (in `RECORD_SCHEMA`) to its partitions' open files; roll full ones.

        Raises `Unappended` (an OSError) naming the rows no open file took. An OSError from
        rolling comes only once every row is in a spool, which stays for the next recovery.
        """
        unappended: list[int] = []
        failure: OSError | None = None
        for key, rows in _partitions(table):
            try:
                self._append_to(key, table if rows is None else table.take(rows))
            except OSError as exc:
                failure = failure or exc
                unappended += range(table.num_rows) if rows is None else rows.to_pylist()
        if failure is not None:
            raise Unappended(sorted(unappended)) from failure
        for key in [k for k, s in self._open.items() if s.bytes >= self.max_file_bytes]:
            self._publish(key)

    def _append_to(self, key: tuple[str, str], part: pa.Table) -> None:
        spool = self._open.get(key)
        if spool is None:
            spool = self._open[key] = self._new_spool(key)
        try:
            spool.append(part)
        except OSError:
            # A batch cut short inside the stream would hide every later one from readers:
            # this spool takes no more, and recovery publishes the complete batches before it.
            del self._open[key]
            with contextlib.suppress(OSError):
                spool.release()
            raise

    def roll_due(self) -> None:
        """Roll the files that reached their age."""
        now = time.monotonic()
        for key in [k for k, s in self._open.items() if now - s.opened_s >= self.max_file_age_s]:
            self._publish(key)

    def roll_all(self) -> None:
        for key in list(self._open):
            self._publish(key)

    @property
    def open_files(self) -> int:
        return len(self._open)

    def recover(self) -> int:
        """Publish the spools no live writer holds (left by a killed process); returns rows."""
        rows = 0
        for path in sorted(self._spool_dir.rglob(f"*{SPOOL_SUFFIX}")):
            try:
                handle = open(path, "rb")  # noqa: SIM115 - closed below, after the lock
            except FileNotFoundError:
                continue
            with handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its writer is alive
                table = read_spool(path)
                relative = path.relative_to(self._spool_dir).as_posix()[: -len(SPOOL_SUFFIX)]
                if table.num_rows:
                    self._write(table, relative)
                    rows += table.num_rows
                path.unlink(missing_ok=True)
        return rows

    def _new_spool(self, key: tuple[str, str]) -> _Spool:
        self._sequence += 1
        date, model = key
        relative = (
            f"date={date}/model={model}/"
            f"part-{self.replica_id}-{time.time_ns():020d}-{self._sequence:06d}.parquet"
        )
        return _Spool(self._spool_dir / f"{relative}{SPOOL_SUFFIX}", relative)

    def _publish(self, key: tuple[str, str]) -> None:
        spool = self._open.pop(key)
        spool.end_stream()
        try:
            # Still locked while it is read, written and removed; after a failure it stays in
            # the spool folder, unlocked, for the next recovery.
            self._write(read_spool(spool.path), spool.relative)
            spool.path.unlink(missing_ok=True)
        finally:
            spool.release()

    def _write(self, table: pa.Table, relative: str) -> None:
        # The final name comes from the spool's: publishing the same spool twice (a kill
        # between the rename and the unlink) replaces the file instead of duplicating rows.
        path = f"{self._root}/{relative}"
        write_table_atomically(table, self._fs, path, row_group_size=ROW_GROUP_ROWS)
        self.files_written += 1
        self.rows_published += table.num_rows


def _partitions(table: pa.Table) -> list[tuple[tuple[str, str], pa.Array | None]]:
    """Each (date, model) partition of `table` with its row numbers (None: every row)."""
    if table.num_rows == 0:
        return []
    dates = pc.strftime(table.column("time"), format="%Y-%m-%d")
    models = table.column("model")
    first = (dates[0].as_py(), models[0].as_py())
    if pc.all(pc.equal(dates, first[0])).as_py() and pc.all(pc.equal(models, first[1])).as_py():
        return [((first[0], safe_segment(first[1])), None)]
    keys = pc.binary_join_element_wise(dates, models, "\x00")
    result = []
    for key in pc.unique(keys).to_pylist():
        date, model = key.split("\x00", 1)
        result.append(((date, safe_segment(model)), pc.indices_nonzero(pc.equal(keys, key))))
    return result


def default_spool_dir(fs: pafs.FileSystem, root: str, replica_id: str) -> Path:
    """Next to the files for a local prefix; in the temp folder for an object store."""
    if isinstance(fs, pafs.LocalFileSystem):
        return Path(root) / "_spool"
    digest = hashlib.sha256(f"{type(fs).__name__}:{root}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "riskserve-spool" / digest


class ExperimentLog:
    """Thread-safe, never-blocking sink of experiment records.

    `log` only appends to a bounded list under a lock; a daemon thread swaps the list out
    every `flush_interval_s` and appends it to the open files. When the buffer holds
    `max_buffered_records`, new records are dropped and counted (and `on_drop(n)` is called,
    e.g. to bump a metric).
    """

    def __init__(
        self,
        prefix: str,
        *,
        replica_id: str | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        max_buffered_records: int = 100_000,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_file_age_s: float = DEFAULT_MAX_FILE_AGE_S,
        spool_dir: str | os.PathLike[str] | None = None,
        filesystem: pafs.FileSystem | None = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        if flush_interval_s <= 0 or max_buffered_records <= 0:
            raise ValueError("flush_interval_s and max_buffered_records must be positive")
        fs, root = resolve_prefix(prefix, filesystem)
        self.replica_id = safe_segment(replica_id) if replica_id else default_replica_id()
        spool = Path(spool_dir) if spool_dir else default_spool_dir(fs, root, self.replica_id)
        self._files = PartitionWriter(
            fs, root, spool, self.replica_id,
            max_file_bytes=max_file_bytes, max_file_age_s=max_file_age_s,
        )  # fmt: skip
        self.flush_interval_s = flush_interval_s
        self.max_buffered_records = max_buffered_records
        self._on_drop = on_drop
        self._buffer: list[tuple[ExperimentRecord, int]] = []  # (record, UTC time in ns)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._roll_requested = False
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.written = 0
        """Records appended to an open file (safe from a process kill from then on)."""
        self.recovered = 0
        """Records published from spools a killed writer left behind."""
        self.write_errors = 0

    @property
    def files_written(self) -> int:
        """Parquet files published so far."""
        return self._files.files_written

    def start(self) -> ExperimentLog:
        """Start the background flusher (idempotent); returns self for chaining.

        Its first act publishes what a killed writer left in the spool folder.
        """
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
        """Append everything buffered now to the open files; returns records appended."""
        with self._write_lock:
            with self._lock:
                batch, self._buffer = self._buffer, []
            appended = self._append(batch) if batch else 0
            self._roll(self._files.roll_due)
            return appended

    def _append(self, batch: list[tuple[ExperimentRecord, int]]) -> int:
        """Append `batch` to the open files; returns how many of its records they took.

        Only the records no file took go back in the buffer: one in a spool is already on its
        way to a Parquet file (now or at the next recovery), and twice would be a duplicate.
        """
        unappended: list[int] = []
        try:
            self._files.append(records_to_table(batch, self.replica_id))
        except Unappended as exc:
            unappended = exc.rows
            self.write_errors += 1
            self._requeue_or_drop([batch[i] for i in unappended])
            _log.exception("writing %d experiment records failed", len(unappended))
        except OSError:  # a full file failed to roll: its spool keeps it for the next recovery
            self.write_errors += 1
            _log.exception("publishing an experiment log file failed")
        appended = len(batch) - len(unappended)
        self.written += appended
        return appended

    def roll(self) -> None:
        """Publish every open file now, with what is buffered (from any thread; never waits:
        the flusher does it at once). The server does it on SIGUSR1."""
        with self._lock:
            self._roll_requested = True
        self._wake.set()

    def recover(self) -> int:
        """Publish spools left by killed writers now (`start` does it too); returns records."""
        with self._write_lock:
            try:
                rows = self._files.recover()
            except OSError:
                self.write_errors += 1
                _log.exception("recovering experiment spools failed")
                return 0
            self.recovered += rows
            return rows

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new records, stop the flusher, write what is left and roll every open file.

        Call on SIGTERM. Blocking: from an event loop, call it through ``asyncio.to_thread``.
        """
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.flush()
        with self._write_lock:
            self._roll(self._files.roll_all)

    def _roll(self, roll: Callable[[], None]) -> None:
        try:
            roll()
        except OSError:  # the spool stays; the next recovery publishes it
            self.write_errors += 1
            _log.exception("publishing an experiment log file failed")

    def _run(self) -> None:
        if self.recover():
            _log.info("published %d experiment records left by a stopped writer", self.recovered)
        while not self._closed:
            self._wake.wait(self.flush_interval_s)
            if self._closed:
                return  # close() does the last flush itself, after join
            self._wake.clear()
            with self._lock:  # taken before the flush: it appends what came before the request
                rolling, self._roll_requested = self._roll_requested, False
            try:
                self.flush()
                if rolling:
                    with self._write_lock:
                        self._roll(self._files.roll_all)
            except Exception:  # the flusher must survive anything a filesystem raises
                _log.exception("experiment log flush failed")

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
