"""The report over logs the service wrote badly: ids missing or repeated, a file cut short."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from riskreport import build_report, render_html, render_summary, shadow_report_main
from service.shadow import ExperimentLog, ExperimentRecord

DAY_NS = 1_772_366_400 * 10**9  # 2026-03-01T12:00:00Z


def answer(
    request_id: str, arm: str, score: float, codes: tuple[str, ...] = ()
) -> ExperimentRecord:
    champion = arm == "champion"
    return ExperimentRecord(
        request_id=request_id, entity_id=f"e-{request_id or score}", experiment="exp",
        model="m", arm="champion" if champion else "challenger", version="1" if champion else "2",
        score=score, decision="APPROVE", engine="x", latency_ms=1.0, mode="shadow",
        served=champion, reason_codes=codes, time_ns=DAY_NS,
    )  # fmt: skip


def test_requests_pair_only_on_an_id_each_arm_logged_once(tmp_path: Path) -> None:
    log = ExperimentLog(str(tmp_path), replica_id="r", flush_interval_s=60)
    for score in (0.1, 0.5, 0.9):  # requests that came without an id (older servers logged "")
        log.log(answer("", "champion", score, ("a",)))
        log.log(answer("", "challenger", score, ("b",)))
    for arm in ("champion", "champion", "challenger"):  # a client reused an id
        log.log(answer("again", arm, 0.3, ("a",)))
    for arm in ("champion", "challenger", "challenger"):  # in the other arm
        log.log(answer("twice", arm, 0.7, ("a",)))
    log.log(answer("one", "champion", 0.2, ("a",)))
    log.log(answer("one", "challenger", 0.25, ("a",)))
    log.log(answer("two", "champion", 0.6, ("a",)))
    log.log(answer("two", "challenger", 0.4, ("c",)))
    log.close()
    labels = tmp_path / "labels.csv"
    labels.write_text("request_id,label\none,0\ntwo,1\n")
    report = build_report(str(tmp_path), labels_path=str(labels))
    (c,) = report.comparisons
    assert c.pairs == 2  # only "one" and "two"
    assert c.auc_difference_method == "paired" and c.auc_difference is not None
    assert c.auc_difference.estimate == 0.0  # both arms rank the two alike
    assert (c.mean_abs_diff, c.max_abs_diff) == pytest.approx((0.125, 0.2))
    assert c.top_reason is not None and (c.top_reason.pairs, c.top_reason.differing) == (2, 1)
    assert c.repeated_request_ids == 2  # "again" and "twice"
    assert report.to_dict()["comparisons"][0]["repeated_request_ids"] == 2
    assert "2 request ids appear more than once in an arm: left unpaired" in render_summary(report)
    assert "request ids repeated in an arm (unpaired)" in render_html(report)


def log_both_arms(prefix: Path, replica_id: str, request_ids: list[str]) -> None:
    log = ExperimentLog(str(prefix), replica_id=replica_id, flush_interval_s=60)
    for i, request_id in enumerate(request_ids):
        log.log(answer(request_id, "champion", i / 10))
        log.log(answer(request_id, "challenger", i / 10))
    log.close()


def test_an_unreadable_parquet_file_is_skipped_named_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    log_both_arms(tmp_path, "a", ["q0", "q1", "q2"])
    log_both_arms(tmp_path, "b", ["q3", "q4"])
    (cut,) = tmp_path.rglob("part-b-*.parquet")
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])  # a file cut short
    with caplog.at_level(logging.WARNING):
        report = build_report(str(tmp_path))
    assert report.records == 6 and report.comparisons[0].pairs == 3
    assert report.unreadable_files == (str(cut),)
    assert any(str(cut) in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "1 unreadable Parquet file skipped" in render_summary(report)
    assert shadow_report_main(["--prefix", str(tmp_path), "--quiet"]) == 0
    assert "1 unreadable Parquet file skipped" in capsys.readouterr().out


def test_an_unreadable_file_whose_spool_is_still_there_is_read_from_the_spool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = ExperimentLog(str(tmp_path), replica_id="a", flush_interval_s=60)
    for i in range(4):
        log.log(answer(f"q{i}", "champion", i / 10))
        log.log(answer(f"q{i}", "challenger", i / 10))
    log.flush()
    (spool,) = (tmp_path / "_spool").rglob("*.arrows")
    published = tmp_path / spool.relative_to(tmp_path / "_spool").with_suffix("")
    published.parent.mkdir(parents=True)
    published.write_bytes(b"PAR1")  # renamed into place, its data never reached the disk
    with caplog.at_level(logging.WARNING):
        report = build_report(str(tmp_path))
    assert (report.records, report.spooled_records) == (8, 8)
    assert report.unreadable_files == (str(published),)
    log.close()
