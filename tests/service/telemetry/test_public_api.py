from __future__ import annotations

import service.telemetry as telemetry


def test_all_lists_exactly_the_public_names():
    public = {
        name
        for name, value in vars(telemetry).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("service.")
    }
    assert (
        set(telemetry.__all__)
        - {
            "BATCH_SIZE_BUCKETS",
            "BATCH_SPAN_NAME",
            "DURATION_BUCKETS_S",
            "SAMPLED_REASON_ATTRIBUTE",
        }
        == public
    )
    for name in telemetry.__all__:
        assert hasattr(telemetry, name)
