from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from shadow_traffic import THRESHOLDS, make_traffic, record
from waiting import wait_until

from service.shadow import ExperimentLog

WRITER = Path(__file__).with_name("shadow_writer_proc.py")
DAY = datetime(2026, 3, 1, 12, tzinfo=UTC)
DAY_NS = int(DAY.timestamp() * 10**9)


def request_ids(prefix: Path) -> list[str]:
    if not parquet_files(prefix):
        return []
    return pads.dataset(prefix, format="parquet").to_table().column("request_id").to_pylist()


def parquet_files(prefix: Path) -> list[Path]:
    return sorted(prefix.rglob("*.parquet"))


def test_hive_layout_by_date_and_model(tmp_path: Path) -> None:
    traffic = make_traffic(10)
    log = ExperimentLog(str(tmp_path), replica_id="host-a/1", flush_interval_s=60)
    for i in range(10):
        log.log(record(traffic, i, "champion", time_ns=DAY_NS + i))
    assert log.flush() == 10 and log.flush() == 0
    assert parquet_files(tmp_path) == []  # appended to the open file, not yet rolled
    log.log(record(traffic, 0, "challenger", time_ns=DAY_NS + 86_400 * 10**9))  # next day
    log.close()
    files = [p.relative_to(tmp_path).parts for p in parquet_files(tmp_path)]
    assert [f[:2] for f in files] == [
        ("date=2026-03-01", "model=fraud-demo"),
        ("date=2026-03-02", "model=fraud-demo"),
    ]
    assert all(f[2].startswith("part-host-a_1-") for f in files)
    assert log.written == 11 and log.files_written == 2 and log.dropped == 0
    table = pq.read_table(tmp_path / Path(*files[0]))
    assert table.column("replica_id").to_pylist() == ["host-a_1"] * 10
    assert table.column("decision").to_pylist() == [
        THRESHOLDS.decide(s) for s in traffic.champion.tolist()
    ]
    assert not list((tmp_path / "_spool").rglob("*.arrows"))  # every spool published
    # Hive readers see the partition columns.
    dataset = pads.dataset(tmp_path, format="parquet", partitioning="hive")
    assert dataset.to_table(filter=pads.field("date") == "2026-03-02").num_rows == 1


def test_files_roll_by_size(tmp_path: Path) -> None:
    traffic = make_traffic(30)
    log = ExperimentLog(str(tmp_path), replica_id="r", flush_interval_s=60, max_file_bytes=1)
    for i in range(30):
        log.log(record(traffic, i, "champion", time_ns=DAY_NS))
        if i % 10 == 9:
            log.flush()
    assert len(parquet_files(tmp_path)) == 3  # each append filled a file
    log.close()
    assert sorted(request_ids(tmp_path)) == sorted(traffic.request_ids)


def test_files_roll_by_age_in_the_background(tmp_path: Path) -> None:
    traffic = make_traffic(5)
    log = ExperimentLog(
        str(tmp_path), replica_id="r", flush_interval_s=0.02, max_file_age_s=0.1
    ).start()
    log.log(record(traffic, 0, "champion"))
    wait_until(lambda: request_ids(tmp_path) == ["req-0"], timeout_s=10)
    log.log(record(traffic, 1, "champion"))
    wait_until(lambda: len(parquet_files(tmp_path)) == 2, timeout_s=10)
    log.close()
    assert sorted(request_ids(tmp_path)) == ["req-0", "req-1"]


def test_a_day_at_2000_per_second_is_a_few_hundred_files(tmp_path: Path) -> None:
    """Files per day from the default roll settings and a real spool's bytes per record."""
    traffic = make_traffic(20_000)
    log = ExperimentLog(str(tmp_path), replica_id="r", flush_interval_s=60)
    for i in range(20_000):
        log.log(replace(record(traffic, i, "champion", time_ns=DAY_NS),
                        request_id=f"{i:032x}", entity_id=f"card-{i % 5000:012d}"))  # fmt: skip
    log.flush()
    (spool,) = (tmp_path / "_spool").rglob("*.arrows")
    bytes_per_record = spool.stat().st_size / 20_000
    records_per_day = 2_000 * 86_400
    by_size = records_per_day * bytes_per_record / log._files.max_file_bytes
    by_age = 86_400 / log._files.max_file_age_s
    files_per_day = math.ceil(max(by_size, by_age)) + 1  # + the file cut at midnight
    assert 200 < files_per_day <= 400, (bytes_per_record, files_per_day)
    log.close()
    assert len(parquet_files(tmp_path)) == 1


def test_full_buffer_drops_and_counts(tmp_path: Path) -> None:
    traffic = make_traffic(10)
    drops: list[int] = []
    log = ExperimentLog(str(tmp_path), max_buffered_records=4, on_drop=drops.append)
    results = [log.log(record(traffic, i, "champion")) for i in range(10)]
    assert results == [True] * 4 + [False] * 6
    assert log.dropped == 6 and sum(drops) == 6
    log.close()
    assert not log.log(record(traffic, 0, "champion"))  # closed
    assert len(request_ids(tmp_path)) == 4


def start_writer(prefix: Path, interval_s: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WRITER), str(prefix), str(interval_s)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )


def spooled(prefix: Path) -> bool:
    return any(p.stat().st_size > 1000 for p in (prefix / "_spool").rglob("*.arrows"))


def test_sigkill_loses_only_what_was_not_flushed(tmp_path: Path) -> None:
    interval_s = 0.2
    writer = start_writer(tmp_path, interval_s)
    # Each accepted id, with how many records the log had written to its file by then. The
    # kill comes once the writer has reported records in its file.
    lines = []
    assert writer.stdout is not None
    for line in writer.stdout:
        lines.append(line)
        if int(line.split()[1]) > 0:
            break
    writer.send_signal(signal.SIGKILL)
    out, _ = writer.communicate(timeout=10)
    lines += out.splitlines()
    accepted = {int(line.split()[0]): int(line.split()[1]) for line in lines}
    flushed = max(accepted.values())
    assert flushed > 0
    assert parquet_files(tmp_path) == []  # the open file was never rolled
    # The next replica on this prefix publishes the dead writer's spool.
    successor = ExperimentLog(str(tmp_path), replica_id="next")
    assert successor.recover() > 0 and successor.recovered > 0
    for path in parquet_files(tmp_path):  # every visible file is complete
        assert pq.read_table(path).num_rows > 0
    stored = [int(r) for r in request_ids(tmp_path)]
    assert len(stored) == len(set(stored)) and set(stored) <= set(accepted) | {max(accepted) + 1}
    lost = set(accepted) - set(stored)
    assert lost, "kill came right after a flush: nothing to check"
    # Only what was not flushed yet is lost: every record written before the kill is stored.
    assert min(lost) >= flushed
    assert stored == sorted(stored) and stored == list(range(len(stored)))
    assert not list((tmp_path / "_spool").rglob("*.arrows"))


def test_sigterm_close_keeps_exactly_one_record_per_accepted_request(tmp_path: Path) -> None:
    writer = start_writer(tmp_path, interval_s=0.3)
    wait_until(lambda: spooled(tmp_path), timeout_s=20)
    writer.send_signal(signal.SIGTERM)
    out, _ = writer.communicate(timeout=20)
    assert writer.returncode == 0
    lines = out.splitlines()
    assert lines[-1] == "closed"
    accepted = sorted(int(line.split()[0]) for line in lines[:-1])
    stored = sorted(int(r) for r in request_ids(tmp_path))
    assert stored == accepted and len(stored) > 0
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".") or p.suffix == ".arrows"]


def test_a_failed_roll_leaves_its_records_in_the_spool_once(tmp_path: Path) -> None:
    traffic = make_traffic(3)
    blocker = tmp_path / "date=2026-03-01"
    blocker.write_text("not a folder")  # publishing (making the partition's folder) fails
    log = ExperimentLog(str(tmp_path), replica_id="r", flush_interval_s=60, max_file_bytes=1)
    for i in range(3):
        log.log(record(traffic, i, "champion", time_ns=DAY_NS + i))
    assert log.flush() == 3  # in the spool, where the next recovery finds them
    assert (log.write_errors, log.buffered, log.dropped) == (1, 0, 0)
    blocker.unlink()
    assert log.flush() == 0
    log.close()
    assert log.written == 3
    assert ExperimentLog(str(tmp_path), replica_id="next").recover() == 3
    assert sorted(request_ids(tmp_path)) == sorted(traffic.request_ids)


def test_a_failed_append_puts_back_only_the_records_no_file_took(tmp_path: Path) -> None:
    traffic = make_traffic(4)
    blocker = tmp_path / "_spool" / "date=2026-03-02"
    blocker.parent.mkdir()
    blocker.write_text("not a folder")  # the next day's open file cannot be made
    log = ExperimentLog(str(tmp_path), replica_id="r", flush_interval_s=60)
    for i in range(4):
        log.log(record(traffic, i, "champion", time_ns=DAY_NS + i % 2 * 86_400 * 10**9))
    assert log.flush() == 2 and (log.write_errors, log.buffered) == (1, 2)
    blocker.unlink()
    assert log.flush() == 2
    log.close()
    assert log.written == 4 and log.files_written == 2
    assert sorted(request_ids(tmp_path)) == sorted(traffic.request_ids)


def test_a_file_is_on_disk_before_its_spool_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    traffic = make_traffic(3)
    log = ExperimentLog(str(tmp_path), replica_id="r", flush_interval_s=60)
    for i in range(3):
        log.log(record(traffic, i, "champion", time_ns=DAY_NS))
    log.flush()
    (spool,) = (tmp_path / "_spool").rglob("*.arrows")
    final = tmp_path / spool.relative_to(tmp_path / "_spool").with_suffix("")
    synced: list[tuple[Path, bool, bool]] = []  # (what, final name there, spool there)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the real call, with what it synced and when
        synced.append((Path(os.readlink(f"/proc/self/fd/{fd}")), final.exists(), spool.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    log.close()
    assert final.exists() and not spool.exists()
    data = [s for s in synced if s[0].parent == final.parent and s[0].name.endswith(".tmp")]
    assert data and data[0][1:] == (False, True)  # its bytes, before it had its name
    assert (final.parent, True, True) in synced  # its name, before the spool went
