"""Read vLLM's own Prometheus figures around a test: counters, gauges, histogram sums/counts.

A test takes a `Snapshot` before and after its requests and compares the deltas with what
phasewatch recorded. Names changed across vLLM versions; `first_present` picks the one this
server exposes. This is a test helper, not the product's scraper (app/phasewatch/engine does that).
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

# vLLM's per-token gap histogram: newer name first, then the one older versions used.
ITL_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")


class Snapshot:
    """Every sample of one /metrics scrape for one model, summed over the other labels."""

    def __init__(self, text: str, model: str) -> None:
        self.values: dict[str, float] = defaultdict(float)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("model_name", model) == model:
                    self.values[sample.name] += sample.value

    def __getitem__(self, name: str) -> float:
        if name not in self.values:
            raise KeyError(f"vLLM does not expose {name}")
        return self.values[name]

    def first_present(self, names: tuple[str, ...], suffix: str) -> str:
        for name in names:
            if name + suffix in self.values:
                return name
        raise KeyError(f"vLLM exposes none of {names}")


def delta(before: Snapshot, after: Snapshot, name: str) -> float:
    return after[name] - before[name]
