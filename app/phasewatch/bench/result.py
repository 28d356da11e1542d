"""A run's result as plain rows: the one form that is exported, stored and printed.

A run is a dict with the columns of the `runs` table and its points are dicts with the columns
of `run_points` (`extra` holding what has no column: per-repeat figures and their spread,
phasewatch's own figures for the same requests, mode details). The JSON export is exactly these
rows, the database stores exactly these rows, and the report is rendered from them, so the
three cannot disagree. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from phasewatch.bench.stats import Figures

RUN_COLUMNS = ("id", "name", "kind", "target", "status", "parameters", "engine", "started_at",
               "finished_at", "summary")
POINT_COLUMNS = (
    "step", "x_name", "x_value", "requests", "errors", "concurrency",
    "ttft_p50_s", "ttft_p90_s", "ttft_p95_s", "ttft_p99_s",
    "itl_p50_s", "itl_p90_s", "itl_p95_s", "itl_p99_s",
    "output_throughput_tps", "total_throughput_tps", "goodput_rps", "extra",
)
# The figures repeats are compared on (keys of `Figures.flat`), and their point columns.
COMPARED = {
    "ttft_p50_s": "ttft_p50_s", "ttft_p95_s": "ttft_p95_s", "ttft_p99_s": "ttft_p99_s",
    "itl_p50_s": "itl_p50_s", "itl_p95_s": "itl_p95_s", "itl_p99_s": "itl_p99_s",
    "output_tps": "output_throughput_tps", "total_tps": "total_throughput_tps",
    "concurrency_mean": "concurrency", "goodput_rps": "goodput_rps",
}


@dataclass(slots=True)
class RunResult:
    run: dict[str, Any]
    points: list[dict[str, Any]]


def spread(repeats: Sequence[dict[str, float | None]]) -> dict[str, float]:
    """Max - min of each figure across repeats (only figures every repeat has; none for one)."""
    if len(repeats) < 2:
        return {}
    out: dict[str, float] = {}
    for key in repeats[0]:
        values = [r.get(key) for r in repeats]
        if all(v is not None for v in values):
            present = [float(v) for v in values if v is not None]
            out[key] = max(present) - min(present)
    return out


def point_row(
    step: int, x_name: str, x_value: float, pooled: Figures, repeats: Sequence[Figures],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A point from its figures, pooled over repeats, with each repeat's kept for the spread."""
    flats = [f.flat() for f in repeats]
    return {
        "step": step, "x_name": x_name, "x_value": float(x_value),
        "requests": pooled.requests, "errors": pooled.errors,
        "concurrency": pooled.concurrency_mean,
        **{f"ttft_{name}_s": value for name, value in pooled.ttft_s.items()},
        **{f"itl_{name}_s": value for name, value in pooled.itl_s.items()},
        "output_throughput_tps": pooled.output_tps,
        "total_throughput_tps": pooled.total_tps,
        "goodput_rps": pooled.goodput_rps,
        "extra": {
            **(extra or {}),
            "figures": {
                "error_kinds": pooled.error_kinds, "itl_max_s": pooled.itl_max_s,
                "tpot_p50_s": pooled.tpot_p50_s, "e2e_p50_s": pooled.e2e_p50_s,
                "prompt_tokens": pooled.prompt_tokens, "output_tokens": pooled.output_tokens,
                "output_chunks": pooled.output_chunks, "span_s": pooled.span_s,
                "request_rps": pooled.request_rps, "concurrency_max": pooled.concurrency_max,
                "tpot_s": pooled.tpot_s, "slo_requests_met": pooled.slo_requests_met,
                "slo_attainment": pooled.slo_attainment, "slo_ttft_over": pooled.slo_ttft_over,
                "slo_itl_over": pooled.slo_itl_over,
            },
            "repeats": flats,
            "spread": spread(flats),
        },
    }


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot export {type(value).__name__}")


def to_json(result: RunResult) -> bytes:
    """The export: `{"run": {...}, "points": [...]}`, times in ISO 8601 with their zone."""
    return orjson.dumps({"run": result.run, "points": result.points},
                        option=orjson.OPT_INDENT_2 | orjson.OPT_PASSTHROUGH_DATETIME,
                        default=_default)


def from_json(data: bytes) -> RunResult:
    body = orjson.loads(data)
    run = dict(body["run"])
    for key in ("started_at", "finished_at"):
        if isinstance(run.get(key), str):
            run[key] = datetime.fromisoformat(run[key])
    return RunResult(run, [dict(p) for p in body["points"]])
