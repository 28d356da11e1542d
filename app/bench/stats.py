"""Pure aggregation of client-side results: no clock, no I/O.

Percentiles are nearest rank (`app.core.quantiles`), the project's one definition. A step's ITL
is reported the way the article's harness does it: the median, across requests, of each
request's median chunk gap (both nearest rank). Throughput is measured, not derived: output
tokens of successful requests divided by the step's wall-clock span (first send -> last end).

`scale` divides every duration (and multiplies throughput) so results from a simulator running
at `--time-scale S` are reported in its model time; 1 for a real server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.bench.client import RequestResult
from app.core.quantiles import percentile, percentiles


@dataclass(frozen=True, slots=True)
class StepStats:
    """One experiment step's summary; durations in seconds (model seconds when scaled)."""

    requests: int
    errors: int
    ttft_p50_s: float | None
    ttft_max_s: float | None
    itl_p50_s: float | None  # median across requests of each request's median gap
    itl_p95_s: float | None  # p95 of all gaps pooled
    itl_max_s: float | None
    output_tokens: int
    elapsed_s: float
    throughput_tps: float  # output tokens / elapsed


def _median(values: Sequence[float]) -> float:
    found = percentiles(values, (0.5,))[0]
    assert found is not None
    return found


def summarize(
    results: Sequence[RequestResult], elapsed_s: float, scale: float = 1.0
) -> StepStats:
    """Summarize one step. Failed requests count as errors and are left out of every latency."""
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft_s / scale for r in ok if r.ttft_s is not None)
    medians = [_median(r.gaps_s) / scale for r in ok if r.gaps_s]
    gaps = sorted(g / scale for r in ok for g in r.gaps_s)
    tokens = sum(r.output_tokens or 0 for r in ok)
    elapsed = elapsed_s / scale
    return StepStats(
        requests=len(results),
        errors=len(results) - len(ok),
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_max_s=ttfts[-1] if ttfts else None,
        itl_p50_s=percentiles(medians, (0.5,))[0],
        itl_p95_s=percentile(gaps, 0.95),
        itl_max_s=gaps[-1] if gaps else None,
        output_tokens=tokens,
        elapsed_s=elapsed,
        throughput_tps=tokens / elapsed if elapsed > 0 else 0.0,
    )
