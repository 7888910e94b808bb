"""The records of one experiment as a DuckDB view, read from every replica's Parquet files.

A local prefix is read by DuckDB's own Parquet reader (every ``*.parquet`` below it, in the
Hive layout or the older per-replica one); an object store prefix through a pyarrow dataset
over the same filesystem the log writes with. Either way only the columns a query names are
read, and the time window is pushed down to the files' row-group statistics.

A local prefix's open files are read too: the complete batches a running server (or its shadow
worker) has appended to its spools and not yet rolled into Parquet, so a report made while the
server runs sees what it accepted up to a flush interval ago. The Parquet files are listed
first; a spool whose Parquet file is among them (published, not yet removed) is skipped, so no
record is read twice.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from service.shadow.errors import NoRecords
from service.shadow.log import SPOOL_SUFFIX, read_spool
from service.shadow.record import RECORD_SCHEMA
from service.shadow.storage import AmbiguousExperiment, resolve_prefix

__all__ = ["AmbiguousExperiment", "open_records", "spooled_rows", "sql_text"]


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
        names = sorted(str(p) for p in Path(root).rglob("*.parquet")) if Path(root).is_dir() else []
        spooled = _spooled(Path(root), set(names))
        if not names and spooled is None:
            raise NoRecords(f"nothing under {prefix}")
        sources = []
        if names:
            # By name: files written before a column was added lack it (read as null).
            listed = "[" + ", ".join(sql_text(n) for n in names) + "]"
            files = f"read_parquet({listed}, hive_partitioning = false, union_by_name = true)"
            columns = {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {files}").fetchall()}
            # A log older than reason codes: none of its records has any.
            codes = "" if "reason_codes" in columns else ", NULL::VARCHAR[] AS reason_codes"
            sources.append(f"SELECT *{codes} FROM {files}")
        if spooled is not None:
            con.register("spooled_records", spooled)
            sources.append("SELECT * FROM spooled_records")
        con.execute(f"CREATE OR REPLACE TEMP VIEW source AS {' UNION ALL BY NAME '.join(sources)}")
    else:
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


def spooled_rows(con: duckdb.DuckDBPyConnection) -> int:
    """Records `open_records` read from open files not yet rolled (0 when it read none)."""
    try:
        return int(con.execute("SELECT count(*) FROM spooled_records").fetchall()[0][0])
    except duckdb.CatalogException:
        return 0


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
