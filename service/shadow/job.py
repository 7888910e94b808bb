"""`ShadowJob`: one served request (or batch) to score again with the challenger versions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["ShadowJob"]


@dataclass(frozen=True, slots=True)
class ShadowJob:
    """The already-validated inputs of served rows, and what the champion answered.

    `inputs` hold the engine arrays named as the champion's ONNX inputs, batch dimension first,
    one row per `request_ids` entry; `champion_scores` are what `champion_version` served.
    With `explain_top_k` > 0 the served request asked for reasons: the worker explains each
    challenger the same way, always or (`explain_when` "adverse") for its REVIEW or DECLINE.
    """

    model: str
    experiment: str
    versions: tuple[str, ...]
    request_ids: tuple[str, ...]
    entity_ids: tuple[str, ...]
    inputs: Mapping[str, np.ndarray]
    champion_scores: np.ndarray
    champion_version: str
    mode: Literal["shadow", "ab"] = "shadow"
    explain_top_k: int = 0
    explain_when: Literal["always", "adverse"] = "always"

    def __post_init__(self) -> None:
        rows = len(self.request_ids)
        if len(self.entity_ids) != rows or len(self.champion_scores) != rows:
            raise ValueError("request_ids, entity_ids and champion_scores must align")
