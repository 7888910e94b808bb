"""Read every replica's experiment files under a prefix as one table."""

from __future__ import annotations

from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from service.shadow.errors import NoRecords, ShadowError
from service.shadow.record import RECORD_SCHEMA
from service.shadow.storage import resolve_prefix

__all__ = ["AmbiguousExperiment", "read_records"]


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
