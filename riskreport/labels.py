"""Outcome labels (CSV or Parquet) as a DuckDB table keyed for the join onto records.

A labels file has a `label` column (1 = bad outcome, 0 = good) and a key: `request_id` when
present, else `entity_id` (an entity's label then applies to all of its records). An optional
`time` column resolves repeated keys: the latest label wins; without it, the last row does.

Keys are joined by their 64-bit hash (DuckDB's `hash`), which keeps the join table to a few
bytes a row: two distinct keys share a hash with probability about n² / 2⁶⁵ (under 2e-5 for
25 million keys), and then one record would take the other's label.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from riskreport.dataset import sql_text
from service.shadow.errors import LabelsError
from service.shadow.storage import resolve_prefix

__all__ = ["load_labels"]


def load_labels(con: duckdb.DuckDBPyConnection, path: str) -> str:
    """Create the table ``labels(key UBIGINT, label TINYINT)``; returns the record column
    its key hashes (``request_id`` or ``entity_id``)."""
    fs, inner = resolve_prefix(path)
    parquet = inner.endswith((".parquet", ".pq"))
    try:
        if isinstance(fs, pafs.LocalFileSystem):
            reader = f"read_parquet({sql_text(inner)})" if parquet else _csv_reader(con, inner)
            con.execute(f"CREATE OR REPLACE TEMP VIEW labels_file AS SELECT * FROM {reader}")
        else:
            con.register("labels_arrow", _read_remote(fs, inner, parquet))
            con.execute("CREATE OR REPLACE TEMP VIEW labels_file AS SELECT * FROM labels_arrow")
        names = {row[0] for row in con.execute("DESCRIBE labels_file").fetchall()}
    except (duckdb.Error, OSError, pa.ArrowInvalid) as exc:
        raise LabelsError(f"cannot read labels file {path.rsplit('/', 1)[-1]}") from exc
    key = "request_id" if "request_id" in names else "entity_id" if "entity_id" in names else None
    if key is None or "label" not in names:
        raise LabelsError("a labels file needs a label column and request_id or entity_id")
    try:
        (bad,) = con.execute(
            "SELECT count(*) FROM labels_file WHERE label IS NULL OR label::DOUBLE NOT IN (0, 1)"
        ).fetchall()[0]
    except duckdb.Error as exc:
        raise LabelsError("labels must be 0 or 1") from exc
    if bad:
        raise LabelsError("labels must be 0 or 1")
    # The latest label by time, else the file's last row (DuckDB keeps insertion order).
    latest = "time, row" if "time" in names else "row"
    con.execute(
        "CREATE OR REPLACE TEMP TABLE labels AS "
        f"SELECT hash({key}::VARCHAR) AS key, arg_max(label::TINYINT, ({latest})) AS label "
        "FROM (SELECT *, row_number() OVER () AS row FROM labels_file) GROUP BY 1"
    )
    return key


def _csv_reader(con: duckdb.DuckDBPyConnection, path: str) -> str:
    """read_csv with the key columns kept as text ("007" stays "007", not the number 7)."""
    names = [row[0] for row in con.execute(f"DESCRIBE SELECT * FROM read_csv({sql_text(path)})")
             .fetchall()]  # fmt: skip
    keys = [n for n in names if n in ("request_id", "entity_id")]
    types = ", ".join(f"{sql_text(k)}: 'VARCHAR'" for k in keys)
    return f"read_csv({sql_text(path)}, types = {{{types}}})"


def _read_remote(fs: pafs.FileSystem, inner: str, parquet: bool) -> pa.Table:
    if parquet:
        return pq.read_table(inner, filesystem=fs)
    text_keys = {"request_id": pa.string(), "entity_id": pa.string()}
    with fs.open_input_stream(inner) as stream:
        return pacsv.read_csv(stream, convert_options=pacsv.ConvertOptions(column_types=text_keys))
