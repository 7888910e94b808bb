"""bench.model_families prints a row per model and batch, with figures that are times."""

from __future__ import annotations

import pytest

from bench.model_families import main


def _table(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_the_table_has_a_row_per_model_and_batch_with_positive_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--families", "logistic,catboost", "--batches", "1,4", "--repetitions", "2"]
    main([*argv, "--warmup", "1", "--history-length", "8"])
    rows = _table(capsys.readouterr().out)

    models = [("fraud-demo", "tensor"), ("logistic", "tensor"), ("logistic", "ZipMap")]
    models.append(("catboost", "ZipMap"))
    assert [(r[0], r[1], int(r[3])) for r in rows] == [
        (*model, batch) for model in models for batch in (1, 4)
    ]
    for row in rows:
        kib, p50, p90, per_row = (float(cell) for cell in (row[2], *row[4:7]))
        assert kib > 0 and 0 < p50 <= p90 and per_row == pytest.approx(p50 / int(row[3]), abs=0.06)
        assert float(row[7].removesuffix("x")) > 0
    assert {r[7] for r in rows if r[0] == "fraud-demo"} == {"1.000x"}


def test_an_unknown_family_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--families", "logistic,svm"])
    assert "svm" in capsys.readouterr().err
