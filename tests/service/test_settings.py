"""Settings that take a structured value: the shadow worker's CPU list, pinned versions,
processes=auto; float settings are finite."""

from __future__ import annotations

import os

import pydantic
import pytest

from service.config import Settings, parse_cpu_list


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", set()), (" ", set()), ("3", {3}), ("0-2", {0, 1, 2}), ("2-3, 6,2", {2, 3, 6})],
)
def test_cpu_lists_read_as_taskset_reads_them(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(
    ("text", "bad"),
    [("x", "'x'"), ("1,,2", "''"), ("3-1", "'3-1'"), ("-1", "'-1'"), ("1-", "'1-'")],
)
def test_a_bad_cpu_list_is_refused_naming_the_part(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        parse_cpu_list(text)


def test_shadow_cpus_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("RISKSERVE_SHADOW_CPUS", "1-2")
    assert Settings(models_dir=tmp_path).shadow_cpu_set == {1, 2}
    monkeypatch.setenv("RISKSERVE_SHADOW_CPUS", "two")
    with pytest.raises(pydantic.ValidationError, match=r"shadow_cpus[\s\S]*'two'"):
        Settings(models_dir=tmp_path)
    monkeypatch.delenv("RISKSERVE_SHADOW_CPUS")
    assert Settings(models_dir=tmp_path).shadow_cpu_set == frozenset()


def test_shadow_cpus_may_be_one_number_in_a_config_file(tmp_path) -> None:
    assert Settings(models_dir=tmp_path, shadow_cpus=3).shadow_cpu_set == {3}


def test_pinned_versions_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    assert Settings(models_dir=tmp_path).pinned_versions == {}
    monkeypatch.setenv("RISKSERVE_PINNED_VERSIONS", '{"fraud-demo": "3"}')
    assert Settings(models_dir=tmp_path).pinned_versions == {"fraud-demo": "3"}
    monkeypatch.setenv("RISKSERVE_PINNED_VERSIONS", '{"fraud-demo": 4}')
    assert Settings(models_dir=tmp_path).pinned_versions == {"fraud-demo": "4"}
    monkeypatch.setenv("RISKSERVE_PINNED_VERSIONS", '["3"]')
    with pytest.raises(pydantic.ValidationError, match="pinned_versions"):
        Settings(models_dir=tmp_path)


def test_processes_auto_is_one_per_usable_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RISKSERVE_PROCESSES", "auto")
    assert Settings(port=50051).processes == len(os.sched_getaffinity(0))


FLOAT_SETTINGS = sorted(
    name
    for name, field in Settings.model_fields.items()
    if field.annotation in (float, float | None)
)


def test_the_float_settings_are_the_expected_ones() -> None:
    assert {"budget_ms", "engine_timeout_ms", "shutdown_grace_s", "trace_slow_ms"} <= set(
        FLOAT_SETTINGS
    )


@pytest.mark.parametrize("name", FLOAT_SETTINGS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_a_float_setting_that_is_not_finite_is_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """`inf` passes a lower bound, then overflows where it becomes a timeout (the engine
    watchdog, HAProxy's configuration); NaN compares false with every limit."""
    monkeypatch.setenv(f"RISKSERVE_{name.upper()}", value)
    with pytest.raises(pydantic.ValidationError) as caught:
        Settings(port=50051)
    (error,) = caught.value.errors()
    assert error["loc"] == (name,)
    assert error["msg"] == "Input should be a finite number"


@pytest.mark.parametrize(
    ("name", "value"),
    [("engine_timeout_ms", "1e300"), ("shutdown_grace_s", "1e12"), ("gather_us", "10" + "0" * 15)],
)
def test_a_duration_of_more_than_a_week_is_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """A finite duration can still overflow where it becomes a wait (1e300 ms in the engine
    watchdog): past a week, a unit was confused."""
    monkeypatch.setenv(f"RISKSERVE_{name.upper()}", value)
    with pytest.raises(pydantic.ValidationError, match=f"{name}: .* is more than a week"):
        Settings(port=50051)
    monkeypatch.setenv(f"RISKSERVE_{name.upper()}", "1")
    assert getattr(Settings(port=50051), name) == 1
