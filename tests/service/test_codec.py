"""The domain request's history read from its wire bytes agrees with reading it value by value."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from engines.manifest import Manifest, load_manifest
from riskscoring.v1 import risk_scoring_pb2 as pb
from service.api.codec import decode_score_batch, decode_score_request
from service.errors import InvalidRequest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def manifest():
    """The demo's manifest without its feature ranges: these tests send arbitrary values."""
    demo = load_manifest(REPO / "models" / "fraud-demo" / "1")
    return Manifest.model_validate({**demo.model_dump(), "feature_ranges": {}})


def request(manifest, rows: np.ndarray) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        features={name: 0.25 * i for i, name in enumerate(manifest.features)},
        history=[pb.HistoryRow(values=row.tolist()) for row in rows],
    )


def test_rows_come_through_exactly(manifest):
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(17, len(manifest.history.fields))).astype(np.float32)
    batch = decode_score_request(request(manifest, rows), manifest)
    assert np.array_equal(batch.history[0, :17], rows)
    assert batch.mask[0, :17].tolist() == [1.0] * 17
    assert not batch.history[0, 17:].any() and not batch.mask[0, 17:].any()
    want = np.array([0.25 * i for i in range(len(manifest.features))], dtype=np.float32)
    assert np.array_equal(batch.features[0], want)


def test_unpacked_rows_are_read_too(manifest):
    """A row's floats may come unpacked (one tag each), as proto parsers must accept."""
    width = len(manifest.history.fields)
    values = [float(v) for v in range(width)]
    row = b"".join(b"\x0d" + struct.pack("<f", v) for v in values)  # field 1, fixed32
    entry = b"\x32" + bytes([len(row)]) + row  # ScoreRequest.history (6), one row
    parsed = pb.ScoreRequest.FromString(entry * 2)
    parsed.features.update({name: 1.0 for name in manifest.features})
    batch = decode_score_request(parsed, manifest)
    assert batch.history[0, :2].tolist() == [values, values]


def test_a_short_row_is_named(manifest):
    width = len(manifest.history.fields)
    good = [pb.HistoryRow(values=[1.0] * width)] * 4
    bad = [*good[:3], pb.HistoryRow(values=[1.0])]
    features = {name: 1.0 for name in manifest.features}
    items = [pb.ScoreRequest(features=features, history=h) for h in (good, bad)]
    with pytest.raises(InvalidRequest, match=r"requests\[1\]\.history\[3\]\.values"):
        decode_score_batch(pb.ScoreBatchRequest(requests=items), manifest)
