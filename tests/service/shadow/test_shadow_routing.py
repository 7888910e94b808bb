from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.shadow import (
    ExperimentConfig,
    ExperimentConfigError,
    ExperimentRouter,
    ModelExperiment,
    Route,
)


def ab_config(share: float, challengers: tuple[str, ...] = ("2",)) -> ExperimentConfig:
    return ExperimentConfig(
        models={
            "fraud-demo": ModelExperiment(
                champion="1", challengers=challengers, mode="ab", ab_share=share
            )
        }
    )


def test_ab_routing_is_sticky_and_share_is_within_tolerance() -> None:
    router = ExperimentRouter(ab_config(0.2))
    routes = {f"e{i}": router.route("fraud-demo", f"e{i}") for i in range(20_000)}
    again = ExperimentRouter(ab_config(0.2))  # a second replica: same answers
    assert all(again.route("fraud-demo", e) == r for e, r in routes.items())
    challenger_share = sum(r.arm == "challenger" for r in routes.values()) / len(routes)
    # binomial sd at n=20000 is 0.0028; 0.015 is more than 5 sd
    assert abs(challenger_share - 0.2) < 0.015
    assert {r.serving_version for r in routes.values() if r.arm == "challenger"} == {"2"}
    assert all(r.shadow_versions == () and r.experiment == "fraud-demo" for r in routes.values())


def test_bucket_is_blake2b_of_the_entity_not_python_hash() -> None:
    router = ExperimentRouter(ab_config(0.5))
    for entity in ("alice", "bob", "carol", "dave", "erin", "frank"):
        digest = hashlib.blake2b(f"ab\x1f\x1ffraud-demo\x1f{entity}".encode(), digest_size=8)
        expected = (
            "challenger" if int.from_bytes(digest.digest(), "big") / 2**64 < 0.5 else "champion"
        )
        assert router.route("fraud-demo", entity).arm == expected


def test_challenger_share_is_split_among_challengers() -> None:
    router = ExperimentRouter(ab_config(0.6, ("2", "3")))
    served = [router.route("fraud-demo", f"e{i}").serving_version for i in range(12_000)]
    assert abs(served.count("2") / 12_000 - 0.3) < 0.03
    assert abs(served.count("3") / 12_000 - 0.3) < 0.03


def test_shadow_mode_serves_champion_and_shadows_a_share() -> None:
    config = ExperimentConfig(
        models={"m": ModelExperiment(champion="1", challengers=("2", "3"), shadow_share=0.25)}
    )
    routes = [ExperimentRouter(config).route("m", f"e{i}") for i in range(8000)]
    assert all(r.serving_version == "1" and r.arm == "champion" for r in routes)
    shadowed = [r for r in routes if r.shadow_versions]
    assert all(r.shadow_versions == ("2", "3") for r in shadowed)
    assert abs(len(shadowed) / 8000 - 0.25) < 0.03


def test_models_without_experiment_are_not_logged() -> None:
    router = ExperimentRouter(ExperimentConfig(models={"plain": ModelExperiment(champion="4")}))
    assert router.route("other", "e") == Route(serving_version=None)
    assert router.route("plain", "e") == Route(serving_version="4")
    assert not router.route("plain", "e").logged


def test_update_swaps_config_while_routing_runs() -> None:
    router = ExperimentRouter(ab_config(0.0))
    assert router.route("fraud-demo", "e1").serving_version == "1"
    seen: set[str | None] = set()
    stop = threading.Event()

    def keep_routing() -> None:
        while not stop.is_set():
            seen.add(router.route("fraud-demo", "e1").serving_version)

    thread = threading.Thread(target=keep_routing)
    thread.start()
    for _ in range(200):
        router.update(ab_config(1.0))
        router.update(ab_config(0.0))
    router.update(ab_config(1.0))
    stop.set()
    thread.join()
    assert seen <= {"1", "2"}
    assert router.route("fraud-demo", "e1").serving_version == "2"


def test_config_validation_and_file(tmp_path: Path) -> None:
    with pytest.raises(ValidationError):
        ModelExperiment(champion="1", challengers=("1",))
    with pytest.raises(ValidationError):
        ModelExperiment(champion="1", ab_share=1.5)
    path = tmp_path / "experiments.json"
    path.write_text(json.dumps({"models": {"m": {"champion": "1", "challengers": ["2"]}}}))
    assert ExperimentConfig.from_json_file(path).models["m"].challengers == ("2",)
    path.write_text("{not json")
    with pytest.raises(ExperimentConfigError):
        ExperimentConfig.from_json_file(path)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"fraud-demo": {"champion": "1"}}', "fraud-demo: Extra inputs are not permitted"),
        (
            '{"models": {"fraud-demo": {"champion": "1", "mode": "canary"}}}',
            "models.fraud-demo.mode: Input should be 'shadow' or 'ab'",
        ),
        (
            '{"models": {"fraud-demo": {"champion": "1", "challengers": ["2"], "share": 0.5}}}',
            "models.fraud-demo.share: Extra inputs are not permitted",
        ),
        (
            '{"models": {"fraud-demo": {"champion": "1", "challengers": ["1"]}}}',
            "models.fraud-demo: Value error, the champion version cannot also be a challenger",
        ),
        ('{"models": {', "not JSON: Expecting property name enclosed in double quotes: line 1"),
    ],
)
def test_a_malformed_experiments_file_is_refused_in_one_line_naming_the_field(
    tmp_path: Path, text: str, reason: str
) -> None:
    path = tmp_path / "experiments.json"
    path.write_text(text)
    with pytest.raises(ExperimentConfigError) as refused:
        ExperimentConfig.from_json_file(path)
    message = str(refused.value)
    assert message.startswith(f"experiments file {path}: {reason}")
    assert "\n" not in message
    path.unlink()
    with pytest.raises(ExperimentConfigError, match="No such file or directory"):
        ExperimentConfig.from_json_file(path)


def test_a_request_without_an_entity_is_never_drawn_into_a_challenger_share() -> None:
    router = ExperimentRouter(ab_config(1.0))  # every entity goes to the challenger
    assert router.route("fraud-demo", "e1").serving_version == "2"
    anonymous = router.route("fraud-demo", "")
    assert (anonymous.serving_version, anonymous.arm, anonymous.mode) == ("1", "champion", "ab")
    assert anonymous.logged


def test_router_names_the_champion_and_the_versions_to_keep() -> None:
    router = ExperimentRouter(ab_config(0.5, ("2", "3")))
    assert router.champion("fraud-demo") == "1"
    assert router.versions("fraud-demo") == ("1", "2", "3")
    assert (router.champion("other"), router.versions("other")) == (None, ())
