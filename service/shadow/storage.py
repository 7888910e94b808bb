"""Where experiment files live: a local folder or an object store URI, behind pyarrow.fs."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

__all__ = ["default_replica_id", "resolve_prefix", "write_table_atomically"]

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

    Locally the file is written under a hidden temporary name (ignored by dataset discovery)
    and renamed. An object store publishes an object only when its upload completes, so
    there the final name is written directly.
    """
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    if not isinstance(fs, pafs.LocalFileSystem):
        pq.write_table(table, path, filesystem=fs, row_group_size=row_group_size)
        return
    name = path.rsplit("/", 1)[1]
    temporary = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp"
    try:
        pq.write_table(table, temporary, filesystem=fs, row_group_size=row_group_size)
        fs.move(temporary, path)
    except BaseException:
        _remove_quietly(fs, temporary)
        raise


def _remove_quietly(fs: pafs.FileSystem, path: str) -> None:
    with contextlib.suppress(OSError):
        fs.delete_file(path)
