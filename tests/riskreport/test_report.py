from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from scipy import stats
from shadow_traffic import THRESHOLDS, Traffic, log_shadow_traffic, make_traffic, record
from sklearn.metrics import confusion_matrix, precision_score, recall_score, roc_auc_score

from riskreport import (
    AmbiguousExperiment,
    build_report,
    render_html,
    render_summary,
    shadow_report_main,
)
from service.shadow import ExperimentLog, NoRecords

N = 1500


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Traffic]:
    root = tmp_path_factory.mktemp("shadow")
    traffic = make_traffic(N)
    logs = [ExperimentLog(str(root / "logs"), replica_id=r, flush_interval_s=60) for r in "ab"]
    log_shadow_traffic(traffic, logs)
    labels = root / "labels.csv"
    pacsv.write_csv(pa.table({"request_id": traffic.request_ids, "label": traffic.labels}), labels)
    return root / "logs", labels, traffic


def decisions(scores: np.ndarray) -> list[str]:
    return [THRESHOLDS.decide(float(s)) for s in scores]


def test_figures_match_scipy_and_sklearn(experiment: tuple[Path, Path, Traffic]) -> None:
    prefix, labels, t = experiment
    report = build_report(str(prefix), labels_path=str(labels), thresholds=THRESHOLDS,
                          bootstrap_resamples=200)  # fmt: skip
    assert report.records == 2 * N and report.replicas == ("a", "b")
    champion, challenger = report.arms
    assert (champion.arm, champion.version, champion.records, champion.served) == (
        "champion", "1", N, N)  # fmt: skip
    assert (challenger.arm, challenger.version, challenger.records, challenger.served) == (
        "challenger", "2", N, 0)  # fmt: skip
    (c,) = report.comparisons
    assert c.pairs == N
    assert c.pearson == pytest.approx(stats.pearsonr(t.champion, t.challenger).statistic, abs=1e-12)
    assert c.spearman == pytest.approx(stats.spearmanr(t.champion, t.challenger).statistic,
                                       abs=1e-12)  # fmt: skip
    ks = stats.ks_2samp(t.champion, t.challenger, method="asymp")
    assert (c.ks_statistic, c.ks_pvalue) == pytest.approx((ks.statistic, ks.pvalue))
    diff = np.abs(t.champion - t.challenger)
    assert (c.mean_abs_diff, c.max_abs_diff) == pytest.approx((diff.mean(), diff.max()))
    order = ["APPROVE", "REVIEW", "DECLINE"]
    expected = confusion_matrix(decisions(t.champion), decisions(t.challenger), labels=order)
    assert [[c.confusion[a][b] for b in order] for a in order] == expected.tolist()
    assert c.decision_agreement == pytest.approx(np.trace(expected) / N)
    for arm, scores in ((champion, t.champion), (challenger, t.challenger)):
        assert arm.labels is not None
        assert arm.labels.auc.estimate == pytest.approx(roc_auc_score(t.labels, scores))
        assert arm.labels.auc.low < arm.labels.auc.estimate < arm.labels.auc.high
        fpr, tpr = np.array(arm.labels.roc).T  # the drawn curve: its area is the AUC
        assert np.trapezoid(tpr, fpr) == pytest.approx(arm.labels.auc.estimate, abs=0.01)
        assert arm.labels.entities == len(set(t.entity_ids))
        flagged_review, flagged_decline = scores >= THRESHOLDS.review, scores >= THRESHOLDS.decline
        assert arm.labels.precision_at_review.estimate == pytest.approx(
            precision_score(t.labels, flagged_review)
        )
        assert arm.labels.recall_at_review.estimate == pytest.approx(
            recall_score(t.labels, flagged_review)
        )
        assert arm.labels.precision_at_decline.estimate == pytest.approx(
            precision_score(t.labels, flagged_decline)
        )
        assert arm.labels.recall_at_decline.estimate == pytest.approx(
            recall_score(t.labels, flagged_decline))  # fmt: skip
        latency = t.champion_latency_ms if arm.arm == "champion" else t.challenger_latency_ms
        assert arm.latency_ms_p99 == pytest.approx(np.percentile(latency, 99))
    assert c.auc_difference is not None and c.auc_difference_method == "paired"
    assert c.auc_difference.estimate == pytest.approx(
        roc_auc_score(t.labels, t.challenger) - roc_auc_score(t.labels, t.champion)
    )
    # The challenger was generated with less noise: its AUC is clearly higher.
    assert c.verdict == "challenger better at 95%"
    assert c.psi > 0


def test_precision_and_recall_count_only_labelled_records(
    experiment: tuple[Path, Path, Traffic], tmp_path: Path
) -> None:
    """Labels come late and for part of the traffic: a flagged record with no label is neither
    a hit nor a miss, so precision is over the flagged records that have a label."""
    prefix, _, t = experiment
    labelled = np.random.default_rng(3).random(N) < 0.6
    labels = tmp_path / "labels.csv"
    ids = [r for r, k in zip(t.request_ids, labelled, strict=True) if k]
    pacsv.write_csv(pa.table({"request_id": ids, "label": t.labels[labelled]}), labels)
    report = build_report(str(prefix), labels_path=str(labels), thresholds=THRESHOLDS)
    y = t.labels[labelled]
    for arm, scores in zip(report.arms, (t.champion, t.challenger), strict=True):
        assert arm.labels is not None
        kept = scores[labelled]
        for level, threshold in (("review", THRESHOLDS.review), ("decline", THRESHOLDS.decline)):
            flagged = kept >= threshold
            precision = getattr(arm.labels, f"precision_at_{level}")
            recall = getattr(arm.labels, f"recall_at_{level}")
            assert precision.estimate == pytest.approx(precision_score(y, flagged))
            assert recall.estimate == pytest.approx(recall_score(y, flagged))
            assert precision.low <= precision.estimate <= precision.high


def test_psi_binning_is_champion_deciles() -> None:
    from riskreport.stats import psi

    rng = np.random.default_rng(3)
    expected, actual = rng.random(10_000), rng.random(10_000) ** 2
    edges = np.quantile(expected, np.linspace(0, 1, 11)[1:-1])
    e = np.histogram(expected, np.r_[-np.inf, edges, np.inf])[0] / 10_000
    a = np.histogram(actual, np.r_[-np.inf, edges, np.inf])[0] / 10_000
    expected, actual = np.sort(expected), np.sort(actual)
    assert psi(expected, actual) == pytest.approx(np.sum((a - e) * np.log(a / e)), rel=1e-6)
    assert psi(expected, expected) == 0


def test_same_scores_give_no_significant_difference(tmp_path: Path) -> None:
    t = make_traffic(600, seed=11)
    log = ExperimentLog(str(tmp_path / "logs"), replica_id="x")
    for i in range(600):
        champion = record(t, i, "champion")
        log.log(champion)
        log.log(replace(record(t, i, "challenger"), score=champion.score + 1e-9,
                        decision=champion.decision))  # fmt: skip
    log.close()
    labels = tmp_path / "labels.csv"
    entity_labels = {e: int(y) for e, y in zip(t.entity_ids, t.labels, strict=True)}
    by_entity = pa.table({"entity_id": list(entity_labels), "label": list(entity_labels.values())})
    pacsv.write_csv(by_entity, labels)
    report = build_report(str(tmp_path / "logs"), labels_path=str(labels), bootstrap_resamples=200)
    (c,) = report.comparisons
    assert c.verdict == "no significant difference at 95%"
    assert c.decision_agreement > 0.99 and c.pearson == pytest.approx(1.0)
    assert report.thresholds is None  # logged decisions were used


def test_the_report_shows_each_challengers_coverage(tmp_path: Path) -> None:
    t = make_traffic(400, seed=5)
    log = ExperimentLog(str(tmp_path / "logs"), replica_id="x", flush_interval_s=60)
    for i in range(400):
        log.log(record(t, i, "champion"))
        if i % 4:  # a quarter of the champion's requests have no challenger answer
            log.log(record(t, i, "challenger"))
    log.close()
    report = build_report(str(tmp_path / "logs"))
    (c,) = report.comparisons
    assert (c.pairs, c.shadowed, c.coverage) == (300, 400, 0.75)
    assert report.to_dict()["comparisons"][0]["shadowed"] == 400
    text = render_summary(report)
    assert "coverage 75.00%: 300 of 400 champion requests in shadow mode have its answer, " \
        "100 have none" in text  # fmt: skip
    assert "champion requests in shadow mode" in render_html(report)


def test_time_window_and_errors(tmp_path: Path) -> None:
    t = make_traffic(20)
    base = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1e9)
    log = ExperimentLog(str(tmp_path / "logs"), replica_id="x")
    for i in range(20):
        log.log(record(t, i, "champion", time_ns=base + i * 60 * 10**9))  # one a minute
    log.close()
    start, end = datetime(2026, 1, 1, 0, 5, tzinfo=UTC), datetime(2026, 1, 1, 0, 10, tzinfo=UTC)
    report = build_report(str(tmp_path / "logs"), start=start, end=end)
    assert report.records == 5 and report.comparisons == ()
    with pytest.raises(NoRecords):
        build_report(str(tmp_path / "logs"), start=datetime(2027, 1, 1, tzinfo=UTC))
    with pytest.raises(NoRecords):
        build_report(str(tmp_path / "missing"))
    other = ExperimentLog(str(tmp_path / "logs"), replica_id="y")
    other.log(replace(record(t, 0, "champion"), experiment="other"))
    other.close()
    with pytest.raises(AmbiguousExperiment):
        build_report(str(tmp_path / "logs"))
    assert build_report(str(tmp_path / "logs"), experiment="other").records == 1


def test_json_html_and_cli(
    experiment: tuple[Path, Path, Traffic], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix, labels, _ = experiment
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    status = shadow_report_main([
        "--prefix", str(prefix), "--labels", str(labels), "--review", "0.5", "--decline", "0.8",
        "--bootstrap", "100", "--json", str(out_json), "--html", str(out_html),
        "--start", "2000-01-01T00:00:00"])  # fmt: skip
    assert status == 0
    terminal = capsys.readouterr()
    data = json.loads(out_json.read_text())
    # The key table in the terminal: per arm, then the comparison and the verdict.
    champion, challenger = data["arms"]
    comparison = data["comparisons"][0]
    assert f"records from {data['first_record']} to {data['last_record']}" in terminal.out
    assert "resampling unit: entity" in terminal.out
    for arm in (champion, challenger):
        auc = arm["labels"]["auc"]
        row = (f"{arm['arm']}  ", f"{arm['records']:,}", f"{arm['labels']['labelled']:,}",
               f"{auc['estimate']:.4f} [{auc['low']:.4f}, {auc['high']:.4f}]")  # fmt: skip
        assert any(all(part in line for part in row) for line in terminal.out.splitlines())
    assert f"PSI {comparison['psi']:.4f}" in terminal.out
    assert f"KS {comparison['ks_statistic']:.4f}" in terminal.out
    assert f"flips {comparison['decision_flips']:,}" in terminal.out
    assert "verdict: challenger better at 95%" in terminal.out
    assert "records read: 3,000\n" in terminal.err  # progress, with what each stage counted
    assert re.search(r"entities numbered: [\d,]+\n", terminal.err) and "rows" not in terminal.err
    assert data["first_record"] <= data["last_record"]
    assert data["records"] == 2 * N and data["thresholds"] == {"review": 0.5, "decline": 0.8}
    assert data["comparisons"][0]["verdict"] == "challenger better at 95%"
    page = out_html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "challenger better at 95%" in page
    assert f"first record {data['first_record']}" in page and " - to -" not in page
    assert "shadow engine call" in page  # the latency plot says what each arm's figure times
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3  # scores, latency, ROC
    assert all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing fetched from elsewhere
    assert shadow_report_main(["--prefix", str(tmp_path / "none")]) == 2


@pytest.mark.parametrize(
    ("options", "error"),
    [
        (["--review", "0.9"], "--review needs --decline: give both thresholds, or --model-dir"),
        (["--decline", "0.5"], "--decline needs --review: give both thresholds, or --model-dir"),
        (["--review", "0.9", "--decline", "0.5"], "--decline 0.5 is below --review 0.9: "),
        (["--review", "1.5", "--decline", "2"], "--review 1.5 is not a score in [0, 1]"),
        (["--model-dir", "m", "--decline", "1"], "--model-dir gives the thresholds: drop"),
    ],
)
def test_thresholds_that_cannot_be_used_are_refused_in_one_line(
    experiment: tuple[Path, Path, Traffic], options: list[str], error: str
) -> None:
    prefix, _, _ = experiment
    done = subprocess.run(
        [sys.executable, "-m", "service", "shadow-report", "--prefix", str(prefix), *options],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"shadow-report: {error}"), line


def test_render_html_without_labels(experiment: tuple[Path, Path, Traffic]) -> None:
    report = build_report(str(experiment[0]), bootstrap_resamples=10)
    page = render_html(report)
    assert page.count("data:image/png;base64,") == 2 and "no labels" in page


def test_repeating_entities_widen_the_interval(tmp_path: Path) -> None:
    """40 entities, each scored 50 times the same way: 2,000 records hold 40 records' worth."""
    t = make_traffic(40, seed=5)
    log = ExperimentLog(str(tmp_path / "logs"), replica_id="x", flush_interval_s=60)
    for i in range(40):
        for repeat in range(50):
            for arm in ("champion", "challenger"):
                log.log(replace(record(t, i, arm), request_id=f"{i}-{repeat}",
                                entity_id=f"card-{i}"))  # fmt: skip
    log.close()
    labels = tmp_path / "labels.csv"
    pacsv.write_csv(pa.table({"entity_id": [f"card-{i}" for i in range(40)],
                             "label": t.labels}), labels)  # fmt: skip
    by_entity = build_report(str(tmp_path / "logs"), labels_path=str(labels))
    by_request = build_report(str(tmp_path / "logs"), labels_path=str(labels), unit="request")
    assert (by_entity.interval_unit, by_request.interval_unit) == ("entity", "request")
    for entity_arm, request_arm in zip(by_entity.arms, by_request.arms, strict=True):
        assert entity_arm.labels is not None and request_arm.labels is not None
        assert (entity_arm.labels.entities, request_arm.labels.entities) == (40, 2000)
        assert entity_arm.labels.auc.estimate == pytest.approx(
            roc_auc_score(t.labels, t.champion if entity_arm.arm == "champion" else t.challenger)
        )
        width = entity_arm.labels.auc.high - entity_arm.labels.auc.low
        narrow = request_arm.labels.auc.high - request_arm.labels.auc.low
        assert width > 4 * narrow  # about sqrt(50) = 7 times wider
    boot = build_report(str(tmp_path / "logs"), labels_path=str(labels), bootstrap_resamples=200)
    assert boot.interval_method == "bootstrap" and boot.arms[0].labels is not None
    boot_width = boot.arms[0].labels.auc.high - boot.arms[0].labels.auc.low
    entity_width = by_entity.arms[0].labels.auc.high - by_entity.arms[0].labels.auc.low  # type: ignore[union-attr]
    assert 0.6 < boot_width / entity_width < 1.6  # both see 40 entities, not 2,000 records


def test_ab_arms_compare_independently(tmp_path: Path) -> None:
    t = make_traffic(800, seed=3)
    log = ExperimentLog(str(tmp_path / "logs"), replica_id="x", flush_interval_s=60)
    for i in range(800):  # A/B: each request goes to one arm only, both served
        arm = "champion" if i % 2 else "challenger"
        log.log(replace(record(t, i, arm), mode="ab", served=True))
    log.close()
    labels = tmp_path / "labels.csv"
    pacsv.write_csv(pa.table({"request_id": t.request_ids, "label": t.labels}), labels)
    report = build_report(str(tmp_path / "logs"), labels_path=str(labels))
    (c,) = report.comparisons
    assert c.pairs == 0 and c.auc_difference_method == "independent"
    odd, even = np.arange(1, 800, 2), np.arange(0, 800, 2)
    expected = roc_auc_score(t.labels[even], t.challenger[even]) - roc_auc_score(
        t.labels[odd], t.champion[odd]
    )
    assert c.auc_difference is not None
    assert c.auc_difference.estimate == pytest.approx(expected)
    assert c.auc_difference.low < c.auc_difference.estimate < c.auc_difference.high
    assert {a.latency_measure for a in report.arms} == {"served request, end to end"}


# Matplotlib's first two colours, which draw the champion's and the challenger's lines.
ARM_COLOURS = ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium here: `make test` installs Debian's chromium where apt-get runs as root",
)
def test_html_report_renders_in_headless_chromium(
    experiment: tuple[Path, Path, Traffic], tmp_path: Path
) -> None:
    """The page as a browser draws it: the three plots decode and show both arms' lines."""
    import matplotlib.image

    prefix, labels, _ = experiment
    page, shot = tmp_path / "report.html", tmp_path / "report.png"
    report = build_report(str(prefix), labels_path=str(labels), thresholds=THRESHOLDS,
                          bootstrap_resamples=50)  # fmt: skip
    page.write_text(render_html(report))
    # No network: the flags keep Chromium from reaching out, which this page never needs.
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-quic", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
         "--window-size=1200,3200", f"--screenshot={shot}", page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (3200, 1200)
    rgb = np.rint(pixels * 255).astype(int)
    for colour in ARM_COLOURS:  # both arms' lines are drawn, so the embedded plots decoded
        near = np.abs(rgb - np.array(colour)).sum(axis=-1) <= 30
        assert near.sum() > 500, colour
    # Rows with ink below the page's top: text, tables and plots all laid out.
    inked_rows = (rgb.min(axis=-1) < 128).any(axis=1)
    assert inked_rows[:200].any() and inked_rows.sum() > 800


def test_the_documented_cluster_query_gives_auc_from_merged_bins(tmp_path: Path) -> None:
    """docs/shadow.md's score-bin query, on Hive-partitioned logs: AUC within 1e-4."""
    import duckdb

    t = make_traffic(3000, seed=13)
    may = int(datetime(2026, 5, 30, 23, 50, tzinfo=UTC).timestamp() * 10**9)
    log = ExperimentLog(str(tmp_path / "logs"), replica_id="x", flush_interval_s=60)
    for i in range(3000):  # twenty minutes across midnight: two date partitions
        for arm in ("champion", "challenger"):
            log.log(replace(record(t, i, arm, time_ns=may + i * 400_000_000),
                            experiment="card-fraud", model="card-fraud"))  # fmt: skip
    log.close()
    assert {p.name for p in (tmp_path / "logs").glob("date=*")} == {
        "date=2026-05-30", "date=2026-05-31"}  # fmt: skip
    outcomes = tmp_path / "outcomes"
    outcomes.mkdir()
    pq.write_table(pa.table({"request_id": t.request_ids, "label": t.labels}),
                   outcomes / "part-0.parquet")  # fmt: skip
    doc = (Path(__file__).parents[2] / "docs" / "shadow.md").read_text()
    (sql,) = re.findall(r"```sql\n(.*?)```", doc, flags=re.S)
    sql = sql.replace("s3://bucket/shadow", str(tmp_path / "logs"))
    sql = sql.replace("s3://bucket/outcomes", str(outcomes))
    with duckdb.connect() as con:
        *setup, query = [s for s in sql.split(";") if s.strip()]
        for statement in setup:
            con.execute(statement)
        rows = con.execute(query).fetchall()
    assert [(arm, version) for arm, version, _ in rows] == [("challenger", "2"), ("champion", "1")]
    for arm, _, auc in rows:
        scores = t.champion if arm == "champion" else t.challenger
        assert auc == pytest.approx(roc_auc_score(t.labels, scores), abs=1e-4)


def test_label_keys_are_text(tmp_path: Path) -> None:
    """A CSV key that looks like a number keeps its digits: "007" is not "7"."""
    t = make_traffic(2)
    log = ExperimentLog(str(tmp_path / "logs"), replica_id="x")
    for i, request_id in enumerate(("007", "7")):
        log.log(replace(record(t, i, "champion"), request_id=request_id))
    log.close()
    labels = tmp_path / "labels.csv"
    labels.write_text("request_id,label\n007,1\n7,0\n")
    report = build_report(str(tmp_path / "logs"), labels_path=str(labels))
    assert report.arms[0].labels is not None
    assert (report.arms[0].labels.labelled, report.arms[0].labels.positives) == (2, 1)


def test_the_prefix_defaults_to_the_servers_log_setting(
    experiment: tuple[Path, Path, Traffic],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("RISKSERVE_SHADOW_LOG_PREFIX", str(experiment[0]))
    assert shadow_report_main(["--quiet"]) == 0
    assert f"{2 * N:,}" in capsys.readouterr().out
