"""Parse an engine's Prometheus text into the few signals diagnosis reads. Pure: no I/O.

vLLM has renamed metrics across versions and exports them per engine (data-parallel rank) and
per model, so the parser reads by sample name against a table of known names (newest first),
accepts either the `vllm:` prefix or `vllm_` (what some relabelling pipelines turn the colon
into), sums the series of one model across engines, and never fails on text it does not know:
unknown metrics are ignored, and lines the Prometheus parser rejects are skipped one by one.

| signal | names (first found wins) | kind | across engines |
|---|---|---|---|
| waiting | `vllm:num_requests_waiting` | gauge | sum |
| running | `vllm:num_requests_running` | gauge | sum |
| kv_usage | `vllm:kv_cache_usage_perc`, `vllm:gpu_cache_usage_perc` (before ~0.10) | 0-1 | max |
| preemptions | `vllm:num_preemptions_total` (counter; v0 and v1) | counter | sum |
| swapped | `vllm:num_requests_swapped` (v0 only) | gauge | sum |
| prompt_tokens | `vllm:prompt_tokens_total` | counter | sum |
| generation_tokens | `vllm:generation_tokens_total` | counter | sum |
| ttft | `vllm:time_to_first_token_seconds` | histogram | sum per bucket |
| queue_time | `vllm:request_queue_time_seconds` | histogram | sum per bucket |

Series are grouped by the `model_name` label (`model` if that is absent; "" if neither). A
KV usage above 1.5 is taken as a percentage and divided by 100.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("vllm:", "vllm_")

# signal -> accepted names without prefix, newest first; how series of one model combine.
GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "waiting": (("num_requests_waiting",), "sum"),
    "running": (("num_requests_running",), "sum"),
    "kv_usage": (("kv_cache_usage_perc", "gpu_cache_usage_perc"), "max"),
    "swapped": (("num_requests_swapped",), "sum"),
    "preemptions": (("num_preemptions_total", "num_preemptions"), "sum"),
    "prompt_tokens": (("prompt_tokens_total", "prompt_tokens"), "sum"),
    "generation_tokens": (("generation_tokens_total", "generation_tokens"), "sum"),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("time_to_first_token_seconds",),
    "queue_time": ("request_queue_time_seconds",),
}


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative histogram: (upper bound, count at or below it), ascending, +Inf last."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float


@dataclass(frozen=True, slots=True)
class EngineState:
    """One model's figures at one scrape; None where the engine did not expose the signal."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0-1
    swapped: float | None = None
    preemptions: float | None = None  # cumulative
    prompt_tokens: float | None = None  # cumulative
    generation_tokens: float | None = None  # cumulative
    ttft: Histogram | None = None
    queue_time: Histogram | None = None


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Every model's state at one scrape, and which metric name supplied each signal."""

    models: Mapping[str, EngineState] = field(default_factory=dict)
    names: Mapping[str, str] = field(default_factory=dict)

    def for_model(self, model: str | None) -> EngineState | None:
        """The state of `model`; the only model's when there is one (a served model name can
        differ from what clients send); None otherwise."""
        if model is not None and model in self.models:
            return self.models[model]
        if len(self.models) == 1:
            return next(iter(self.models.values()))
        return None


def _strip(name: str) -> str | None:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def _samples(text: str) -> Iterator[tuple[str, Mapping[str, str], float]]:
    """Every sample as (name, labels, value); a text the parser rejects is read line by line,
    skipping the lines it cannot parse."""
    try:
        parsed = [(s.name, s.labels, float(s.value))
                  for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError):
        parsed = []
        for line in text.splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            try:
                for family in text_string_to_metric_families(line + "\n"):
                    parsed.extend((s.name, s.labels, float(s.value)) for s in family.samples)
            except (ValueError, TypeError, IndexError):
                continue
    yield from parsed


_GAUGE_NAMES = {name: (signal, rank) for signal, (names, _) in GAUGES.items()
                for rank, name in enumerate(names)}
_HISTOGRAM_NAMES = {name: signal for signal, names in HISTOGRAMS.items() for name in names}


def parse_engine_metrics(text: str) -> EngineSnapshot:
    """The diagnosis signals in an engine's /metrics text, per model. Never raises on content."""
    # (signal, rank of the name, model) -> summed or maxed value
    gauges: dict[tuple[str, int, str], float] = {}
    # (signal, name, model) -> {le: count}, sum, count
    buckets: dict[tuple[str, str, str], dict[float, float]] = defaultdict(dict)
    sums: dict[tuple[str, str, str], float] = defaultdict(float)
    counts: dict[tuple[str, str, str], float] = defaultdict(float)
    for full_name, labels, value in _samples(text):
        name = _strip(full_name)
        if name is None or name.endswith("_created") or math.isnan(value):
            continue
        model = labels.get("model_name", labels.get("model", ""))
        found = _GAUGE_NAMES.get(name)
        if found is not None:
            signal, rank = found
            key = (signal, rank, model)
            combine = GAUGES[signal][1]
            if key not in gauges:
                gauges[key] = value
            elif combine == "max":
                gauges[key] = max(gauges[key], value)
            else:
                gauges[key] += value
            continue
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name[: -len(suffix)] in _HISTOGRAM_NAMES:
                base = name[: -len(suffix)]
                hkey = (_HISTOGRAM_NAMES[base], base, model)
                if suffix == "_bucket":
                    try:
                        bound = float(labels.get("le", "nan"))
                    except ValueError:
                        break
                    if not math.isnan(bound):
                        table = buckets[hkey]
                        table[bound] = table.get(bound, 0.0) + value
                elif suffix == "_sum":
                    sums[hkey] += value
                else:
                    counts[hkey] += value
                break

    values: dict[str, dict[str, float | Histogram]] = defaultdict(dict)
    names: dict[str, str] = {}
    for signal, (accepted, _) in GAUGES.items():
        for model in {m for (s, _, m) in gauges if s == signal}:
            rank = min(r for (s, r, m) in gauges if s == signal and m == model)
            value = gauges[(signal, rank, model)]
            if signal == "kv_usage" and value > 1.5:
                value /= 100.0  # a percentage, not a fraction
            values[model][signal] = value
            names[signal] = "vllm:" + accepted[rank]
    for (signal, base, model), table in buckets.items():
        if signal in values[model]:
            continue
        ordered = tuple(sorted(table.items()))
        count = counts.get((signal, base, model), ordered[-1][1] if ordered else 0.0)
        values[model][signal] = Histogram(ordered, count, sums.get((signal, base, model), 0.0))
        names[signal] = "vllm:" + base

    models: dict[str, EngineState] = {}
    for model, figures in values.items():
        def number(signal: str, figures: dict[str, float | Histogram] = figures) -> float | None:
            value = figures.get(signal)
            return value if isinstance(value, float) else None

        def histogram(signal: str,
                      figures: dict[str, float | Histogram] = figures) -> Histogram | None:
            value = figures.get(signal)
            return value if isinstance(value, Histogram) else None

        models[model] = EngineState(
            waiting=number("waiting"), running=number("running"), kv_usage=number("kv_usage"),
            swapped=number("swapped"), preemptions=number("preemptions"),
            prompt_tokens=number("prompt_tokens"),
            generation_tokens=number("generation_tokens"),
            ttft=histogram("ttft"), queue_time=histogram("queue_time"),
        )
    return EngineSnapshot(models, names)
