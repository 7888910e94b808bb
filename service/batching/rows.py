"""`RowBatch`: the one shape a request's rows have from decoding to the engine.

The codec builds it from the wire, the batcher queues and merges it, the explainer builds its
blocks, and `RowBatch.feed` names its arrays as the model's inputs for the engine.
`RowBatch.concat` is the one place histories are padded: to the longest row of what it joins,
zeros after each row's length, with the mask saying which rows are real.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engines.manifest import HistorySpec, Manifest

__all__ = ["MAX_PADDING", "RowBatch", "length_groups"]

# A batch's padded history cells may be at most this multiple of its rows' own cells: padding a
# short history to a long one costs the engine the long one's work (the attention over the
# history grows faster than linearly), more than the fixed cost a shared call saves.
MAX_PADDING = 1.5


@dataclass(frozen=True, slots=True)
class RowBatch:
    """Validated rows of one model: what the batcher queues and the engines consume."""

    features: np.ndarray  # (n, F) float32
    history: np.ndarray | None  # (n, T, H) float32, zero-padded after each row's length
    mask: np.ndarray | None  # (n, T) float32, 1 for a real row, 0 for padding

    @property
    def rows(self) -> int:
        return int(self.features.shape[0])

    @property
    def history_length(self) -> int:
        return 0 if self.history is None else int(self.history.shape[1])

    @property
    def shares_history(self) -> bool:
        """Several rows against one history: a model whose manifest declares
        `history.broadcast` scores each feature row with it (an explained request's block)."""
        return self.history is not None and self.history.shape[0] == 1 and self.rows > 1

    @property
    def cells(self) -> int:
        """The engine's work in history cells: one per history row computed, one per row
        without a history of its own."""
        if self.history is None:
            return self.rows
        histories = int(self.history.shape[0])
        return histories * max(self.history_length, 1) + self.rows - histories

    @classmethod
    def single(
        cls, features: np.ndarray, history: np.ndarray, spec: HistorySpec | None
    ) -> RowBatch:
        """One row: a feature vector (F,) and its history (L, H), unpadded unless the model
        needs at least `spec.min_padded_length` rows."""
        if spec is None:
            return cls(features[np.newaxis], None, None)
        length = history.shape[0]
        if length >= spec.min_padded_length:
            return cls(
                features[np.newaxis],
                history[np.newaxis],
                np.ones((1, length), dtype=np.float32),
            )
        return cls.concat([cls(features[np.newaxis], history[np.newaxis], None)], spec)

    @classmethod
    def concat(cls, parts: Sequence[RowBatch], spec: HistorySpec | None = None) -> RowBatch:
        """The parts' rows in order, every history padded to the longest (and to at least
        `spec.min_padded_length`); a part without a mask has every history row real. A part
        alone is returned as it is; one that `shares_history` joined with others has its one
        history repeated for each of its rows."""
        if len(parts) == 1 and parts[0].mask is not None:
            return parts[0]
        features = np.concatenate([p.features for p in parts])
        first = parts[0].history
        if first is None:
            return cls(features, None, None)
        floor = spec.min_padded_length if spec is not None else 1
        length = max(floor, max(p.history_length for p in parts))
        rows = features.shape[0]
        history = np.zeros((rows, length, first.shape[2]), dtype=np.float32)
        mask = np.zeros((rows, length), dtype=np.float32)
        start = 0
        for part in parts:
            end = start + part.rows
            history[start:end, : part.history_length] = part.history
            if part.mask is None:
                mask[start:end, : part.history_length] = 1.0
            else:
                mask[start:end, : part.history_length] = part.mask
            start = end
        return cls(features, history, mask)

    def history_lengths(self) -> np.ndarray:
        """Each row's own history length: up to its last real history row. A row with no real
        one (a history emptied for an explanation) keeps the padded length it has here, so it
        is never scored against a shorter padding than it was given."""
        if self.history is None:
            return np.zeros(self.rows, dtype=np.intp)
        width = self.history_length
        if self.mask is None:
            return np.full(self.rows, width, dtype=np.intp)
        real = self.mask > 0
        if self.shares_history:
            real = np.broadcast_to(real, (self.rows, width))
        last = width - np.argmax(real[:, ::-1], axis=1)
        return np.where(real.any(axis=1), last, width).astype(np.intp)

    def take(self, index: np.ndarray, length: int) -> RowBatch:
        """The rows at `index`, their histories cut (or padded) to `length` rows."""
        if self.history is None or self.mask is None:
            return RowBatch(self.features[index], None, None)
        width = self.history_length
        rows = np.zeros_like(index) if self.shares_history else index
        history, mask = self.history[rows, :length], self.mask[rows, :length]
        if length > width:
            pad = length - width
            history = np.pad(history, ((0, 0), (0, pad), (0, 0)))
            mask = np.pad(mask, ((0, 0), (0, pad)))
        return RowBatch(self.features[index], history, mask)

    def feed(self, manifest: Manifest) -> dict[str, np.ndarray]:
        """The engine inputs, named as the model's ONNX inputs."""
        inputs = {manifest.features_input: self.features}
        spec = manifest.history
        if spec is not None and self.history is not None and self.mask is not None:
            inputs[spec.input] = self.history
            inputs[spec.mask_input] = self.mask
        return inputs


def length_groups(
    lengths: np.ndarray,
    max_rows: int,
    max_padding: float = MAX_PADDING,
    max_cells: int | None = None,
) -> list[np.ndarray]:
    """Row positions grouped for one engine call each, as the batcher groups requests: by
    ascending history length, at most `max_rows` a group, its cells padded to its longest row
    at most `max_padding` times the rows' own cells, and (with `max_cells`) at most that many
    padded cells unless it is one row."""
    order = np.argsort(lengths, kind="stable")
    groups: list[np.ndarray] = []
    start = own = 0
    for k, position in enumerate(order.tolist()):
        length = max(int(lengths[position]), 1)
        rows = k - start + 1
        padded = rows * length
        if rows > 1 and (
            rows > max_rows
            or padded > max_padding * (own + length)
            or (max_cells is not None and padded > max_cells)
        ):
            groups.append(order[start:k])
            start, own = k, 0
        own += length
    if len(order):
        groups.append(order[start:])
    return groups
