"""The records of one experiment as a DuckDB view, read from every replica's Parquet files.

A local prefix is read by DuckDB's own Parquet reader (every ``*.parquet`` below it, in the
Hive layout or the older per-replica one); an object store prefix through a pyarrow dataset
over the same filesystem the log writes with. Either way only the columns a query names are
read, and the time window is pushed down to the files' row-group statistics.

A local prefix's open files are read too: the complete batches a running server (or its shadow
worker) has appended to its spools and not yet rolled into Parquet, so a report made while the
server runs sees what it accepted up to a flush interval ago. The Parquet files are listed
first; a spool whose Parquet file is among them (published, not yet removed) is skipped, so no
record is read twice. A Parquet file that cannot be read (cut short by a crash) is skipped with
a warning naming it, and counted in the report; its spool is read instead if it is still there.
"""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from service.shadow.errors import NoRecords
from service.shadow.log import SPOOL_SUFFIX, read_spool
from service.shadow.record import RECORD_SCHEMA
from service.shadow.storage import AmbiguousExperiment, resolve_prefix

__all__ = ["AmbiguousExperiment", "open_records", "spooled_rows", "sql_text", "unreadable_files"]

_log = logging.getLogger(__name__)


def sql_text(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def open_records(
    con: duckdb.DuckDBPyConnection,
    prefix: str,
    *,
    experiment: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    filesystem: pafs.FileSystem | None = None,
) -> str:
    """Create the view ``records`` (start <= time < end, one experiment); returns its name.

    Raises `NoRecords` when nothing matches and `AmbiguousExperiment` when several
    experiments do and none was chosen.
    """
    fs, root = resolve_prefix(prefix, filesystem)
    if isinstance(fs, pafs.LocalFileSystem):
        _open_local(con, prefix, Path(root))
    else:
        _keep_unreadable(con, [])  # an object appears only once its upload completes
        try:
            dataset = pads.dataset(root, schema=RECORD_SCHEMA, format="parquet", filesystem=fs)
        except FileNotFoundError as exc:
            raise NoRecords(f"nothing under {prefix}") from exc
        con.register("source_dataset", dataset)
        con.execute("CREATE OR REPLACE TEMP VIEW source AS SELECT * FROM source_dataset")
    window = ["TRUE"]
    if start is not None:
        window.append(f"time >= {_timestamp(start)}")
    if end is not None:
        window.append(f"time < {_timestamp(end)}")
    where = " AND ".join(window)
    found = con.execute(
        f"SELECT experiment, count(*) FROM source WHERE {where} GROUP BY 1 ORDER BY 1"
    ).fetchall()
    names = [name for name, _ in found]
    if experiment is not None:
        names = [n for n in names if n == experiment]
    if not names:
        raise NoRecords("no experiment records match the prefix and time window")
    if len(names) > 1:
        raise AmbiguousExperiment(f"several experiments: {sorted(names)}; choose one")
    con.execute(
        "CREATE OR REPLACE TEMP VIEW records AS SELECT * FROM source "
        f"WHERE {where} AND experiment = {sql_text(names[0])}"
    )
    return "records"


def _open_local(con: duckdb.DuckDBPyConnection, prefix: str, root: Path) -> None:
    """The view ``source``: the Parquet files under `root`, then its open files' batches."""
    names = sorted(str(p) for p in root.rglob("*.parquet")) if root.is_dir() else []
    described, unreadable = _readable_files(con, names)
    _keep_unreadable(con, unreadable)
    # A spool whose Parquet file cannot be read is read instead, if it is still there.
    spooled = _spooled(root, set(names) - set(unreadable))
    if described is None and spooled is None:
        raise NoRecords(f"nothing under {prefix}")
    sources = []
    if described is not None:
        files, columns = described
        # A log older than reason codes: none of its records has any.
        codes = "" if "reason_codes" in columns else ", NULL::VARCHAR[] AS reason_codes"
        sources.append(f"SELECT *{codes} FROM {files}")
    if spooled is not None:
        con.register("spooled_records", spooled)
        sources.append("SELECT * FROM spooled_records")
    con.execute(f"CREATE OR REPLACE TEMP VIEW source AS {' UNION ALL BY NAME '.join(sources)}")


def spooled_rows(con: duckdb.DuckDBPyConnection) -> int:
    """Records `open_records` read from open files not yet rolled (0 when it read none)."""
    try:
        return int(con.execute("SELECT count(*) FROM spooled_records").fetchall()[0][0])
    except duckdb.CatalogException:
        return 0


def unreadable_files(con: duckdb.DuckDBPyConnection) -> tuple[str, ...]:
    """The Parquet files `open_records` skipped because they cannot be read."""
    return tuple(row[0] for row in con.execute("SELECT path FROM unreadable_parquet").fetchall())


def _readable_files(
    con: duckdb.DuckDBPyConnection, names: list[str]
) -> tuple[tuple[str, set[str]] | None, list[str]]:
    """(`_described` over the readable files of `names`, or None when there are none; the
    unreadable ones). A file cut short (a crash before it reached the disk) costs its own
    records, not the report."""
    if not names:
        return None, []
    try:
        return _described(con, names), []
    except duckdb.Error:  # a footer is unreadable: find which, then try again without them
        errors = {name: error for name in names if (error := _footer_error(name))}
        if not errors:
            raise
    for name, error in errors.items():
        _log.warning("skipping the unreadable Parquet file %s (%s)", name, error)
    unreadable = list(errors)
    readable = [name for name in names if name not in set(unreadable)]
    return (_described(con, readable) if readable else None), unreadable


def _described(con: duckdb.DuckDBPyConnection, names: list[str]) -> tuple[str, set[str]]:
    """(SQL reading the Parquet files `names`, the columns it reads)."""
    # By name: files written before a column was added lack it (read as null).
    listed = "[" + ", ".join(sql_text(n) for n in names) + "]"
    files = f"read_parquet({listed}, hive_partitioning = false, union_by_name = true)"
    return files, {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {files}").fetchall()}


def _footer_error(path: str) -> str | None:
    try:
        pq.read_metadata(path)
    except (pa.ArrowException, OSError) as exc:
        return str(exc) or type(exc).__name__
    return None


def _keep_unreadable(con: duckdb.DuckDBPyConnection, names: list[str]) -> None:
    con.execute("CREATE OR REPLACE TEMP TABLE unreadable_parquet (path VARCHAR)")
    if names:
        con.executemany("INSERT INTO unreadable_parquet VALUES (?)", [[n] for n in names])


def _spooled(root: Path, published: set[str]) -> pa.Table | None:
    """The complete batches of the open files under a local prefix, or None when there are
    none; a spool whose Parquet file is in `published` is already read from there."""
    spool_dir = root / "_spool"
    if not spool_dir.is_dir():
        return None
    tables = []
    for path in sorted(spool_dir.rglob(f"*{SPOOL_SUFFIX}")):
        relative = path.relative_to(spool_dir).as_posix()[: -len(SPOOL_SUFFIX)]
        if str(root / relative) in published:
            continue
        table = read_spool(path)  # a spool rolled meanwhile reads as empty
        if table.num_rows:
            tables.append(table)
    return pa.concat_tables(tables) if tables else None


def _timestamp(moment: datetime) -> str:
    if moment.tzinfo is None:
        raise ValueError("start and end must carry a time zone (naive times are ambiguous)")
    return f"TIMESTAMPTZ {sql_text(moment.isoformat())}"
