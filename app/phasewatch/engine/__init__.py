"""The engine's own view: scrape vLLM's Prometheus `/metrics` and read what diagnosis needs.

`parser` (pure: text in, `EngineSnapshot` out, tolerant of the metric renames across vLLM
versions) and `window` (pure: a window's figures from a series of snapshots) hold no I/O;
`scraper` is the background task that fetches the text on a schedule and keeps recent
snapshots in memory; `metrics` are its own Prometheus gauges.
"""

from phasewatch.engine.parser import EngineSnapshot, parse_engine_metrics

__all__ = ["EngineSnapshot", "parse_engine_metrics"]
