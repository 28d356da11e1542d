"""The scraper's own Prometheus metrics, on an injected registry.

Only the leading process scrapes (app/phasewatch/store/leader.py); the others keep `up` at 0, so
read it as the max over instances (and over workers: its multiprocess mode is `livemax`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class EngineScrapeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge(
            "phasewatch_engine_scrape_up",
            "1 if the leading process's last scrape of the engine's /metrics succeeded, else 0.",
            registry=registry, multiprocess_mode="livemax",
        )
        self.failures = Counter(
            "phasewatch_engine_scrape_failures",
            "Scrapes of the engine's /metrics that failed (unreachable, non-200, timeout).",
            registry=registry,
        )
