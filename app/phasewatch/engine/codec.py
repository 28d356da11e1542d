"""An `EngineSnapshot` to JSON and back, for storing scrapes
(app/phasewatch/store/engine_scrapes.py). Pure.

Every process reads the scrapes the leading process stored, so what one stores must read back
equal. JSON has no infinities (a histogram's `+Inf` bound; Postgres refuses `Infinity`), so a
number that is not finite is written as its text ("inf", "-inf", "nan").
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from phasewatch.engine.parser import EngineSnapshot, EngineState, Histogram

_HISTOGRAMS = frozenset(("ttft", "queue_time"))
_KNOWN = frozenset(field.name for field in fields(EngineState))


def _number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def _histogram_json(histogram: Histogram) -> dict[str, Any]:
    return {"buckets": [[_number(bound), _number(count)] for bound, count in histogram.buckets],
            "count": _number(histogram.count), "sum": _number(histogram.sum)}


def _histogram(data: dict[str, Any]) -> Histogram:
    return Histogram(tuple((float(bound), float(count)) for bound, count in data["buckets"]),
                     float(data["count"]), float(data["sum"]))


def snapshot_to_json(snapshot: EngineSnapshot) -> dict[str, Any]:
    models: dict[str, Any] = {}
    for model, state in snapshot.models.items():
        figures: dict[str, Any] = {}
        for field in fields(EngineState):
            value = getattr(state, field.name)
            if value is None:
                continue
            figures[field.name] = (_histogram_json(value) if isinstance(value, Histogram)
                                   else _number(value))
        models[model] = figures
    return {"models": models, "names": dict(snapshot.names)}


def snapshot_from_json(data: dict[str, Any]) -> EngineSnapshot:
    models = {}
    for model, figures in data.get("models", {}).items():
        state: dict[str, Any] = {}
        for name, value in figures.items():
            if name in _KNOWN:  # a signal a later version stored is skipped
                state[name] = _histogram(value) if name in _HISTOGRAMS else float(value)
        models[model] = EngineState(**state)
    return EngineSnapshot(models, dict(data.get("names", {})))
