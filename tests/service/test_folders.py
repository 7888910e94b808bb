"""Version folders: which names are numeric versions and the order they sort in."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from modelkit import write_tabular_model

from service.models.folders import discover_models, version_key


def test_numeric_versions_sort_numerically_after_the_others() -> None:
    names = ["10", "2", "beta", "1", "alpha"]
    assert sorted(names, key=version_key) == ["alpha", "beta", "1", "2", "10"]


@pytest.mark.parametrize("name", ["²", "①", "٣", "1²", "Ⅻ"])
def test_only_ascii_digits_make_a_numeric_version(name: str) -> None:
    """str.isdigit() holds for '²' and '①', which int() refuses, and for '٣', which int()
    reads as 3: only ASCII digits make a numeric version."""
    assert version_key(name) == (0, name)
    assert sorted(["2", name, "1"], key=version_key) == [name, "1", "2"]


def test_an_oddly_named_version_folder_stops_no_model(tmp_path: Path) -> None:
    first = write_tabular_model(tmp_path, version="1")
    shutil.copytree(first, first.parent / "²")
    write_tabular_model(tmp_path, version="10")
    write_tabular_model(tmp_path, name="other", version="3")
    found = discover_models(tmp_path)
    assert [p.name for p in found["credit-lite"]] == ["²", "1", "10"]
    assert [p.name for p in found["other"]] == ["3"]
