"""Outcome labels (CSV or Parquet) and their join onto experiment records.

A labels file has a `label` column (1 = bad outcome, 0 = good) and a key: `request_id` when
present, else `entity_id` (an entity's label then applies to all of its records). An optional
`time` column resolves repeated keys: the latest label wins; without it, the last row does.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from service.shadow.errors import LabelsError
from service.shadow.storage import resolve_prefix

__all__ = ["Labels", "read_labels"]

UNLABELLED = -1


class Labels:
    """Key column name and a key -> 0/1 mapping."""

    def __init__(self, key: str, by_key: dict[str, int]) -> None:
        self.key = key
        self.by_key = by_key

    def lookup(self, table: pa.Table) -> np.ndarray:
        """Label per record row (int8), `UNLABELLED` where the file has none."""
        keys = table.column(self.key).to_pylist()
        return np.array([self.by_key.get(k, UNLABELLED) for k in keys], dtype=np.int8)


def read_labels(path: str) -> Labels:
    fs, inner = resolve_prefix(path)
    try:
        if inner.endswith((".parquet", ".pq")):
            table = pq.read_table(inner, filesystem=fs)
        else:
            with fs.open_input_stream(inner) as stream:
                table = pacsv.read_csv(stream)
    except (OSError, pa.ArrowInvalid) as exc:
        raise LabelsError(f"cannot read labels file {path.rsplit('/', 1)[-1]}") from exc
    return _from_table(table)


def _from_table(table: pa.Table) -> Labels:
    names = set(table.column_names)
    key = "request_id" if "request_id" in names else "entity_id" if "entity_id" in names else None
    if key is None or "label" not in names:
        raise LabelsError("a labels file needs a label column and request_id or entity_id")
    if "time" in names:
        table = table.take(pc.sort_indices(table, [("time", "ascending")]))
    keys = pc.cast(table.column(key), pa.string()).to_pylist()
    values = table.column("label").to_numpy(zero_copy_only=False).astype(np.float64)
    if np.any((values != 0) & (values != 1)):
        raise LabelsError("labels must be 0 or 1")
    return Labels(key, dict(zip(keys, values.astype(int).tolist(), strict=True)))
