"""A live server's Prometheus page, read as the tests need it."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["scraped_total"]


def scraped_total(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` on the page at `url` whose labels include `labels`."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
