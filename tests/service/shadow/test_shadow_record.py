"""The record schema across writer versions: older spools read as today's schema."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from shadow_traffic import make_traffic, record

from service.shadow import RECORD_SCHEMA
from service.shadow.log import read_spool
from service.shadow.record import records_to_table


def test_a_spool_left_by_a_writer_without_reason_codes_is_read(tmp_path: Path) -> None:
    traffic = make_traffic(5)
    rows = [(record(traffic, i, "champion"), 1_700_000_000_000_000_000 + i) for i in range(5)]
    old = records_to_table(rows, "replica").drop_columns(["reason_codes"])
    path = tmp_path / "part.arrows"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, old.schema) as writer:
        writer.write_table(old)
    table = read_spool(path)
    assert table.schema == RECORD_SCHEMA
    assert table.column("request_id").to_pylist() == traffic.request_ids
    assert table.column("reason_codes").null_count == 5
