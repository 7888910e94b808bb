"""Where experiment files live: a local folder or an object store URI, behind pyarrow.fs."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import uuid
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from service.shadow.errors import NoRecords, ShadowError
from service.shadow.record import RECORD_SCHEMA

__all__ = [
    "AmbiguousExperiment",
    "default_replica_id",
    "read_records",
    "resolve_prefix",
    "write_table_atomically",
]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def default_replica_id() -> str:
    """Host name and process id, safe as one path segment."""
    return safe_segment(f"{socket.gethostname()}-{os.getpid()}")


def safe_segment(text: str) -> str:
    cleaned = _UNSAFE.sub("_", text).strip("._")
    return cleaned or "replica"


def resolve_prefix(
    prefix: str, filesystem: pafs.FileSystem | None = None
) -> tuple[pafs.FileSystem, str]:
    """Return (filesystem, path inside it) for a folder path or a URI such as ``s3://bucket/x``.

    With an explicit `filesystem`, `prefix` is a path inside it (``bucket/x`` for S3).
    """
    if filesystem is not None:
        return filesystem, prefix.rstrip("/")
    if "://" in prefix:
        fs, path = pafs.FileSystem.from_uri(prefix)
        return fs, path.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(prefix)


def write_table_atomically(
    table: pa.Table, fs: pafs.FileSystem, path: str, *, row_group_size: int | None = None
) -> None:
    """Write a complete Parquet file that readers see whole or not at all.

    Locally the file is written under a hidden temporary name (ignored by dataset discovery),
    synced to disk, renamed, and its folder synced: once this returns, the file survives a
    power loss, so its source (a spool) may go. An object store publishes an object only when
    its upload completes, so there the final name is written directly.
    """
    parent = path.rsplit("/", 1)[0]
    if not isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(parent, recursive=True)
        pq.write_table(table, path, filesystem=fs, row_group_size=row_group_size)
        return
    _make_folders_durably(parent)
    name = path.rsplit("/", 1)[1]
    temporary = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp"
    try:
        pq.write_table(table, temporary, filesystem=fs, row_group_size=row_group_size)
        # Without it a rename can reach the disk before the data: after a power loss the
        # name would point at a file cut short, and the spool it came from would be gone.
        _fsync(temporary)
        fs.move(temporary, path)
    except BaseException:
        _remove_quietly(fs, temporary)
        raise
    _fsync(parent)  # the rename itself


def _make_folders_durably(folder: str) -> None:
    """`mkdir -p`, syncing the parent of each folder it makes (a new partition's name)."""
    missing = []
    current = Path(folder)
    while not current.is_dir():
        missing.append(current)
        current = current.parent
    Path(folder).mkdir(parents=True, exist_ok=True)
    for made in reversed(missing):
        _fsync(str(made.parent))


def _fsync(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove_quietly(fs: pafs.FileSystem, path: str) -> None:
    with contextlib.suppress(OSError):
        fs.delete_file(path)


class AmbiguousExperiment(ShadowError):
    """The prefix holds several experiments and none was chosen."""


def read_records(
    prefix: str,
    *,
    experiment: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    filesystem: pafs.FileSystem | None = None,
) -> pa.Table:
    """Records under `prefix` (all sub-folders, all replicas) with start <= time < end."""
    fs, root = resolve_prefix(prefix, filesystem)
    try:
        dataset = pads.dataset(root, schema=RECORD_SCHEMA, format="parquet", filesystem=fs)
    except FileNotFoundError as exc:
        raise NoRecords(f"nothing under {prefix}") from exc
    condition = pc.scalar(True)
    if experiment is not None:
        condition = condition & (pc.field("experiment") == experiment)
    if start is not None:
        condition = condition & (pc.field("time") >= _utc_scalar(start))
    if end is not None:
        condition = condition & (pc.field("time") < _utc_scalar(end))
    table = dataset.to_table(filter=condition)
    if table.num_rows == 0:
        raise NoRecords("no experiment records match the prefix and time window")
    experiments = pc.unique(table.column("experiment")).to_pylist()
    if len(experiments) > 1:
        raise AmbiguousExperiment(f"several experiments: {sorted(experiments)}; choose one")
    return table


def _utc_scalar(moment: datetime) -> pa.Scalar:
    if moment.tzinfo is None:
        raise ValueError("start and end must carry a time zone (naive times are ambiguous)")
    return pa.scalar(moment, type=pa.timestamp("ns", tz="UTC"))
