"""Train the `fraud-demo` model on generator data and export it to ONNX with its manifest.

Run from the repository root in the training environment (PyTorch, onnx, onnxruntime,
scikit-learn)::

    python -m demo.train --out models/fraud-demo/1 --seed 0

Writes ``model.onnx``, ``manifest.json`` and ``calibration.npz`` into ``--out`` and prints the
held-out AUC. Data seeds derive from ``--seed``: training ``seed``, validation (AUC, thresholds)
``seed + VALIDATION_SEED_OFFSET``, calibration ``seed + CALIBRATION_SEED_OFFSET``.

The network: an MLP over the tabular features, and a small pre-norm Transformer encoder over the
history rows (no positional encoding: order is carried by ``hours_since_prev``) pooled by a masked
mean and a masked max, plus ``log1p`` of the number of real rows; a head over both gives one
logit, and the exported graph ends in a sigmoid. Normalisation (training means and standard
deviations, then a clip to +-8) is part of the graph, so callers send raw values. Padded rows are
excluded from attention by an additive bias of -1e4 (finite, so an all-padding row stays finite
and the value fits in FP16) and from pooling by the mask. After export, `demo.share_history` lets
the graph score many feature rows against one history (``history.broadcast`` in the manifest).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from demo.cutoffs import add_training_arguments, thresholds
from demo.generator import (
    FEATURE_NAMES,
    FEATURE_RANGES,
    HISTORY_FIELDS,
    DemoData,
    generate,
    model_inputs,
)
from demo.share_history import share_history

VALIDATION_SEED_OFFSET = 1_000_003
CALIBRATION_SEED_OFFSET = 2_000_003
_MASK_BIAS = 1e4
_CLIP = 8.0
OPSET = 17


class _EncoderBlock(nn.Module):
    """Pre-norm self-attention and feed-forward, with an additive key-padding bias."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.norm_attn = nn.LayerNorm(d_model)
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm_ff = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        x_norm = self.norm_attn(x)
        q, k, v = (
            layer(x_norm).reshape(batch, length, self.n_heads, self.d_head).transpose(1, 2)
            for layer in (self.query, self.key, self.value)
        )
        scores = q @ k.transpose(-1, -2) * (self.d_head**-0.5) + key_bias
        attended = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + self.proj(attended)
        return x + self.ff(self.norm_ff(x))


class FraudNet(nn.Module):
    """Tabular MLP plus history Transformer; returns logits (`Scorer` gives probabilities)."""

    def __init__(
        self,
        stats: dict[str, np.ndarray],
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        d_ff: int = 128,
    ) -> None:
        super().__init__()
        for name, value in stats.items():
            self.register_buffer(name, torch.as_tensor(value, dtype=torch.float32))
        n_features, n_fields = len(FEATURE_NAMES), len(HISTORY_FIELDS)
        self.tabular = nn.Sequential(
            nn.Linear(n_features, 128), nn.ReLU(), nn.Linear(128, d_model), nn.ReLU()
        )
        self.row_in = nn.Linear(n_fields, d_model)
        self.blocks = nn.ModuleList(_EncoderBlock(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.seq_norm = nn.LayerNorm(d_model)
        self.head = nn.Sequential(nn.Linear(3 * d_model + 1, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(
        self, features: torch.Tensor, history: torch.Tensor, history_mask: torch.Tensor
    ) -> torch.Tensor:
        x = torch.clamp((features - self.feature_mean) / self.feature_std, -_CLIP, _CLIP)
        h = torch.clamp((history - self.history_mean) / self.history_std, -_CLIP, _CLIP)
        rows = self.row_in(h)
        key_bias = ((history_mask - 1.0) * _MASK_BIAS).unsqueeze(1).unsqueeze(1)
        for block in self.blocks:
            rows = block(rows, key_bias)
        rows = self.seq_norm(rows)
        mask = history_mask.unsqueeze(-1)
        count = mask.sum(dim=1)
        mean = (rows * mask).sum(dim=1) / torch.clamp(count, min=1.0)
        peak = (rows * mask + (mask - 1.0) * _MASK_BIAS).amax(dim=1)
        peak = peak * torch.clamp(count, max=1.0)  # 0 for an empty history
        pooled = torch.cat([self.tabular(x), mean, peak, torch.log1p(count)], dim=-1)
        return self.head(pooled)


class Scorer(nn.Module):
    """The exported graph: the network's probability, shape (batch, 1)."""

    def __init__(self, net: FraudNet) -> None:
        super().__init__()
        self.net = net

    def forward(
        self, features: torch.Tensor, history: torch.Tensor, history_mask: torch.Tensor
    ) -> torch.Tensor:
        return torch.sigmoid(self.net(features, history, history_mask))


def _stats(data: DemoData) -> dict[str, np.ndarray]:
    rows = np.concatenate([h for h in data.histories if len(h)], axis=0).astype(np.float64)
    feats = data.features.astype(np.float64)
    return {
        "feature_mean": feats.mean(axis=0),
        "feature_std": np.maximum(feats.std(axis=0), 1e-3),
        "history_mean": rows.mean(axis=0),
        "history_std": np.maximum(rows.std(axis=0), 1e-3),
    }


def _batches(
    data: DemoData, batch_size: int, rng: np.random.Generator | None
) -> list[tuple[np.ndarray, dict[str, torch.Tensor]]]:
    """Batches of similar history length (less padding); shuffled when ``rng`` is given."""
    lengths = np.array([len(h) for h in data.histories])
    order = np.argsort(
        lengths + (rng.random(len(lengths)) if rng is not None else 0), kind="stable"
    )
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if rng is not None:
        chunks = [chunks[i] for i in rng.permutation(len(chunks))]
    out = []
    for idx in chunks:
        part = DemoData(
            entity_ids=[],
            features=data.features[idx],
            histories=[data.histories[i] for i in idx],
            labels=data.labels[idx],
        )
        out.append((idx, {k: torch.from_numpy(v) for k, v in model_inputs(part).items()}))
    return out


def _predict(model: nn.Module, data: DemoData) -> np.ndarray:
    model.eval()
    scores = np.empty(len(data.labels), np.float64)
    with torch.no_grad():
        for idx, inputs in _batches(data, 1024, None):
            scores[idx] = model(**inputs).squeeze(-1).numpy()
    return scores


def fit(train: DemoData, epochs: int, seed: int, batch_size: int = 512) -> FraudNet:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    net = FraudNet(_stats(train))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    labels = torch.from_numpy(train.labels.astype(np.float32))
    steps = epochs * ((len(labels) + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    loss_fn = nn.BCEWithLogitsLoss()
    step = 0
    for epoch in range(epochs):
        net.train()
        started = time.monotonic()
        total = 0.0
        for idx, inputs in _batches(train, batch_size, rng):
            loss = loss_fn(net(**inputs).squeeze(-1), labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
            step += 1
            if step % 50 == 0:
                print(f"  step {step}/{steps} loss {loss.item():.4f}", flush=True)
        elapsed_s = time.monotonic() - started
        print(f"epoch {epoch + 1}/{epochs} loss {total / len(labels):.4f} ({elapsed_s:.0f} s)")
    return net


def _export(scorer: Scorer, sample: dict[str, np.ndarray], path: Path) -> None:
    scorer.eval()
    args = tuple(torch.from_numpy(sample[k]) for k in ("features", "history", "history_mask"))
    torch.onnx.export(
        scorer,
        args,
        str(path),
        input_names=["features", "history", "history_mask"],
        output_names=["score"],
        dynamic_axes={
            "features": {0: "batch"},
            "history": {0: "batch", 1: "history_length"},
            "history_mask": {0: "batch", 1: "history_length"},
            "score": {0: "batch"},
        },
        opset_version=OPSET,
        dynamo=False,
    )
    onnx.save(share_history(onnx.load(str(path))), str(path))


def _manifest(review: float, decline: float, auc: float) -> dict:
    profile = {"batch": [1, 16, 64], "history_length": [1, 32, 64]}
    return {
        "name": "fraud-demo",
        "version": "1",
        "description": (
            "Card-fraud demo: tabular MLP plus a Transformer over the account's history, "
            f"trained on demo.generator data (held-out AUC {auc:.3f}); see docs/demo-model.md."
        ),
        "features_input": "features",
        "features": list(FEATURE_NAMES),
        "history": {
            "input": "history",
            "mask_input": "history_mask",
            "fields": list(HISTORY_FIELDS),
            "max_length": 256,
            "min_padded_length": 1,
            "broadcast": True,
        },
        "output": "score",
        "nan_policy": "reject",
        "thresholds": {"review": review, "decline": decline},
        "fallback_decision": "REVIEW",
        "max_batch_size": 256,
        "profiles": {"fp16": [profile, profile], "int8": [profile, profile]},
        "variants": {},
        "calibration": "calibration.npz",
        "feature_ranges": {name: list(FEATURE_RANGES[name]) for name in FEATURE_NAMES},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    from sklearn.metrics import roc_auc_score

    train = generate(args.train_size, args.seed)
    validation = generate(args.validation_size, args.seed + VALIDATION_SEED_OFFSET)
    calibration = model_inputs(generate(512, args.seed + CALIBRATION_SEED_OFFSET))
    print(f"train {len(train.labels)} rows, fraud rate {train.labels.mean():.4f}")
    net = fit(train, args.epochs, args.seed)
    scorer = Scorer(net)

    args.out.mkdir(parents=True, exist_ok=True)
    model_path = args.out / "model.onnx"
    _export(scorer, calibration, model_path)
    np.savez_compressed(args.out / "calibration.npz", **calibration)

    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    scores = np.empty(len(validation.labels), np.float64)
    for idx, inputs in _batches(validation, 1024, None):
        feed = {k: v.numpy() for k, v in inputs.items()}
        scores[idx] = session.run(["score"], feed)[0][:, 0]
    torch_scores = _predict(scorer, validation)
    auc = float(roc_auc_score(validation.labels, scores))
    review, decline = thresholds(
        scores, validation.labels, args.review_rate, args.decline_precision
    )
    manifest = _manifest(review, decline, auc)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    flagged, declined = scores >= review, scores >= decline
    fraud = validation.labels == 1
    print(f"max |onnxruntime - torch| {np.abs(scores - torch_scores).max():.2e}")
    print(f"held-out AUC {auc:.4f} ({len(scores)} rows, seed {args.seed + VALIDATION_SEED_OFFSET})")
    print(
        f"review >= {review}: {flagged.mean():.2%} of rows, "
        f"recall {flagged[fraud].mean():.2%}, precision {validation.labels[flagged].mean():.2%}"
    )
    print(
        f"decline >= {decline}: {declined.mean():.2%} of rows, "
        f"recall {declined[fraud].mean():.2%}, precision {validation.labels[declined].mean():.2%}"
    )
    print(f"model.onnx {model_path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
