"""One scored request of an experiment, and its columnar schema."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import pyarrow as pa

__all__ = [
    "RECORD_SCHEMA",
    "ExperimentRecord",
    "columns_to_table",
    "conform",
    "records_to_table",
]

RECORD_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("entity_id", pa.string(), nullable=False),
        pa.field("time", pa.timestamp("ns", tz="UTC"), nullable=False),
        pa.field("experiment", pa.string(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("arm", pa.string(), nullable=False),
        pa.field("version", pa.string(), nullable=False),
        pa.field("score", pa.float64(), nullable=False),
        pa.field("decision", pa.string(), nullable=False),
        pa.field("engine", pa.string(), nullable=False),
        pa.field("latency_ms", pa.float64(), nullable=False),
        pa.field("mode", pa.string(), nullable=False),
        pa.field("served", pa.bool_(), nullable=False),
        pa.field("replica_id", pa.string(), nullable=False),
        # Absent from logs written before reasons were logged: read as null, meaning none.
        pa.field("reason_codes", pa.list_(pa.string())),
    ]
)


@dataclass(frozen=True, slots=True)
class ExperimentRecord:
    """What one arm answered for one request; `served` says whether the caller got this answer."""

    request_id: str
    entity_id: str
    experiment: str
    model: str
    arm: Literal["champion", "challenger"]
    version: str
    score: float
    decision: str
    engine: str
    latency_ms: float
    mode: Literal["shadow", "ab"]
    served: bool
    reason_codes: tuple[str, ...] = ()
    """This arm's top reason codes, largest contribution first; empty when none were asked or
    given (an approval in "adverse" mode)."""
    time_ns: int = 0
    """UTC wall-clock time in ns since the epoch; 0 means "now" when the record is logged."""

    def stamped(self) -> ExperimentRecord:
        if self.time_ns:
            return self
        return replace(self, time_ns=time.time_ns())


def records_to_table(stamped: list[tuple[ExperimentRecord, int]], replica_id: str) -> pa.Table:
    """Build one table in `RECORD_SCHEMA` from (record, time in ns) pairs, column by column."""
    records = [r for r, _ in stamped]
    columns = {
        "request_id": [r.request_id for r in records],
        "entity_id": [r.entity_id for r in records],
        "time": [t for _, t in stamped],
        "experiment": [r.experiment for r in records],
        "model": [r.model for r in records],
        "arm": [r.arm for r in records],
        "version": [r.version for r in records],
        "score": [float(r.score) for r in records],
        "decision": [r.decision for r in records],
        "engine": [r.engine for r in records],
        "latency_ms": [float(r.latency_ms) for r in records],
        "mode": [r.mode for r in records],
        "served": [r.served for r in records],
        "replica_id": [replica_id] * len(records),
        "reason_codes": [list(r.reason_codes) for r in records],
    }
    return columns_to_table(columns)


def columns_to_table(columns: Mapping[str, object]) -> pa.Table:
    """One table in `RECORD_SCHEMA` from a column per field (lists, numpy or Arrow arrays);
    without ``reason_codes`` no record has reasons."""
    data = dict(columns)
    if "reason_codes" not in data:
        rows = len(data["request_id"])  # type: ignore[arg-type]
        data["reason_codes"] = pa.nulls(rows, RECORD_SCHEMA.field("reason_codes").type)
    return pa.Table.from_pydict(data, schema=RECORD_SCHEMA)


def conform(table: pa.Table) -> pa.Table:
    """A table written before ``reason_codes`` was logged, in `RECORD_SCHEMA` (null codes)."""
    if "reason_codes" in table.schema.names:
        return table.select(RECORD_SCHEMA.names).cast(RECORD_SCHEMA)
    field = RECORD_SCHEMA.field("reason_codes")
    return table.append_column(field, pa.nulls(len(table), field.type)).cast(RECORD_SCHEMA)
