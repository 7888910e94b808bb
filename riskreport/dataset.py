"""The records of one experiment as a DuckDB view, read from every replica's Parquet files.

A local prefix is read by DuckDB's own Parquet reader (every ``*.parquet`` below it, in the
Hive layout or the older per-replica one); an object store prefix through a pyarrow dataset
over the same filesystem the log writes with. Either way only the columns a query names are
read, and the time window is pushed down to the files' row-group statistics.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from service.shadow.errors import NoRecords
from service.shadow.record import RECORD_SCHEMA
from service.shadow.storage import AmbiguousExperiment, resolve_prefix

__all__ = ["AmbiguousExperiment", "open_records", "sql_text"]


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
        if not Path(root).is_dir() or next(Path(root).rglob("*.parquet"), None) is None:
            raise NoRecords(f"nothing under {prefix}")
        # By name: files written before a column was added lack it (read as null).
        files = f"read_parquet({sql_text(root + '/**/*.parquet')}, hive_partitioning = false, " \
            "union_by_name = true)"  # fmt: skip
        columns = {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {files}").fetchall()}
        # A log older than reason codes: none of its records has any.
        codes = "" if "reason_codes" in columns else ", NULL::VARCHAR[] AS reason_codes"
        con.execute(f"CREATE OR REPLACE TEMP VIEW source AS SELECT *{codes} FROM {files}")
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


def _timestamp(moment: datetime) -> str:
    if moment.tzinfo is None:
        raise ValueError("start and end must carry a time zone (naive times are ambiguous)")
    return f"TIMESTAMPTZ {sql_text(moment.isoformat())}"
