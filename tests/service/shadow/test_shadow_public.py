from __future__ import annotations

import service.shadow as shadow


def test_public_surface_is_exactly_all() -> None:
    public = {name for name in vars(shadow) if not name.startswith("_")}
    modules = {"channel", "cli", "dataset", "errors", "experiment", "html", "job", "labels",
               "log", "priority", "record", "report", "runner", "scorer", "stats",
               "storage", "worker"}  # fmt: skip
    assert public - modules == set(shadow.__all__)
    assert all(getattr(shadow, name) is not None for name in shadow.__all__)
