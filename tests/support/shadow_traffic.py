"""Synthetic experiment traffic with a known generative process, shared by the shadow tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.manifest import Thresholds
from service.shadow import ExperimentLog, ExperimentRecord

THRESHOLDS = Thresholds(review=0.5, decline=0.8)


@dataclass(frozen=True)
class Traffic:
    request_ids: list[str]
    entity_ids: list[str]
    labels: np.ndarray
    champion: np.ndarray
    challenger: np.ndarray
    champion_latency_ms: np.ndarray
    challenger_latency_ms: np.ndarray


def make_traffic(n: int, seed: int = 7) -> Traffic:
    """Latent risk drives the label; the challenger sees it with less noise than the champion."""
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=n)
    labels = (rng.random(n) < 1 / (1 + np.exp(-(2.5 * latent - 1.5)))).astype(int)
    champion = 1 / (1 + np.exp(-(latent + rng.normal(scale=1.2, size=n))))
    challenger = 1 / (1 + np.exp(-(latent + rng.normal(scale=0.5, size=n))))
    return Traffic(
        request_ids=[f"req-{i}" for i in range(n)],
        entity_ids=[f"ent-{i % (n // 3 + 1)}" for i in range(n)],
        labels=labels,
        champion=champion,
        challenger=challenger,
        champion_latency_ms=rng.lognormal(np.log(2.0), 0.3, size=n),
        challenger_latency_ms=rng.lognormal(np.log(3.0), 0.3, size=n),
    )


def record(traffic: Traffic, i: int, arm: str, time_ns: int = 0) -> ExperimentRecord:
    champion = arm == "champion"
    score = float(traffic.champion[i] if champion else traffic.challenger[i])
    latency = traffic.champion_latency_ms if champion else traffic.challenger_latency_ms
    return ExperimentRecord(
        request_id=traffic.request_ids[i],
        entity_id=traffic.entity_ids[i],
        experiment="fraud-demo",
        model="fraud-demo",
        arm="champion" if champion else "challenger",
        version="1" if champion else "2",
        score=score,
        decision=THRESHOLDS.decide(score),
        engine="onnxruntime-cpu",
        latency_ms=float(latency[i]),
        mode="shadow",
        served=champion,
        time_ns=time_ns,
    )


def log_shadow_traffic(traffic: Traffic, logs: list[ExperimentLog]) -> None:
    """Request i goes to replica i % len(logs), which logs both arms; then every log closes."""
    for i in range(len(traffic.request_ids)):
        log = logs[i % len(logs)]
        assert log.log(record(traffic, i, "champion"))
        assert log.log(record(traffic, i, "challenger"))
    for log in logs:
        log.close()
