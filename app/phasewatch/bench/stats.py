"""Pure aggregation of client-side results: no clock, no I/O.

Percentiles are nearest rank (`phasewatch.core.quantiles`), the project's one definition. The demo's
`summarize` reports a step's ITL the way the article's harness does: the median, across
requests, of each request's median chunk gap. The bench's `figures` pools every chunk gap of a
point instead, and reports p50/p90/p95/p99 of TTFT and ITL, the achieved concurrency, goodput
against an SLO pair and error kinds (definitions in docs/bench.md). Throughput is measured, not
derived: tokens of successful requests divided by the wall-clock span (first send -> last end).

Goodput has one definition, per request, as `vllm bench serve --goodput ttft:T tpot:I` has it:
a request is good when it succeeded, its TTFT is at most T and its TPOT (its mean gap between
tokens) at most I. Goodput is good requests / span; a point meets the SLO when at least the
`quantile`'s share of its requests (95 % for p95) is good. The same `Slo.good` decides both.

`scale` divides every duration (and multiplies throughput) so results from a simulator running
at `--time-scale S` are reported in its model time; 1 for a real server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phasewatch.bench.client import RequestResult
from phasewatch.core.quantiles import percentile, percentiles


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


# -- per-point figures of the bench (`phasewatch bench`) ------------------------------------------

QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p95", 0.95), ("p99", 0.99))


def named_quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p90, p95, p99 (nearest rank) of `values`; None each when there are none."""
    found = percentiles(values, [q for _, q in QUANTILES])
    return {name: value for (name, _), value in zip(QUANTILES, found, strict=True)}


@dataclass(frozen=True, slots=True)
class Slo:
    """A TTFT and ITL objective pair, judged per request (`good`): a point meets it when the
    `quantile`'s share of its requests is good (p95: 95 %) and at most `max_error_rate` of them
    failed. The ITL objective applies to each request's TPOT, as vLLM's goodput does."""

    ttft_s: float
    itl_s: float
    quantile: str = "p95"  # one of p50, p90, p95, p99: the share of requests that must be good
    max_error_rate: float = 0.0

    @property
    def attainment(self) -> float:
        """The share of requests that must be good: 0.95 for p95."""
        return int(self.quantile.removeprefix("p")) / 100

    def describe(self) -> str:
        return (f"{self.attainment:.0%} of requests with TTFT <= {self.ttft_s * 1e3:g} ms and "
                f"TPOT <= {self.itl_s * 1e3:g} ms, errors <= {self.max_error_rate:.0%}")

    def good(self, result: RequestResult, scale: float = 1.0) -> bool:
        """The one test of a request, for goodput and the verdict alike (model seconds)."""
        tpot = tpot_s(result)
        return (result.ok and result.ttft_s is not None
                and result.ttft_s / scale <= self.ttft_s
                and (tpot is None or tpot / scale <= self.itl_s))


def tpot_s(result: RequestResult) -> float | None:
    """First output event -> last, per output token after the first (client clock, seconds)."""
    if not result.ok or len(result.output_ns) < 2 or not result.output_tokens:
        return None
    if result.output_tokens < 2:
        return None
    return (result.output_ns[-1] - result.output_ns[0]) / 1e9 / (result.output_tokens - 1)


def error_kind(error: str) -> str:
    """A short, stable name for an error message (its part before any detail)."""
    return error.split(":", 1)[0].strip()[:60]


def concurrency_max(results: Sequence[RequestResult]) -> int:
    """The most requests open at once on the client (send -> end), over `results`."""
    edges = sorted([(r.sent_ns, 1) for r in results] + [(r.ended_ns, -1) for r in results],
                   key=lambda edge: (edge[0], edge[1]))
    open_now = most = 0
    for _, step in edges:
        open_now += step
        most = max(most, open_now)
    return most


@dataclass(frozen=True, slots=True)
class Figures:
    """One point (or one repeat of it); every duration in seconds, every rate per second, both
    on the model's clock when `scale` was given (see `figures`)."""

    requests: int
    errors: int
    error_kinds: dict[str, int]
    ttft_s: dict[str, float | None]  # over ok requests
    itl_s: dict[str, float | None]  # over every chunk gap of ok requests, pooled
    itl_max_s: float | None
    tpot_p50_s: float | None  # median over ok requests of each one's TPOT
    tpot_s: dict[str, float | None]  # quantiles of the same per-request TPOTs
    e2e_p50_s: float | None
    prompt_tokens: int  # of ok requests, from usage
    output_tokens: int
    output_chunks: int  # output-carrying events: tokens / chunks > 1 means merged chunks
    span_s: float  # first send -> last end (summed over repeats when pooled)
    output_tps: float  # output tokens / span
    total_tps: float  # (prompt + output tokens) / span
    request_rps: float  # ok requests / span
    concurrency_mean: float  # sum of every request's send -> end, / span (Little's law)
    concurrency_max: int
    goodput_rps: float | None  # good requests (Slo.good) / span; None without an SLO
    slo_requests_met: int | None  # good requests
    slo_attainment: float | None  # good requests / requests (failed ones count as not good)
    slo_ttft_over: int | None  # ok requests over the TTFT objective
    slo_itl_over: int | None  # ok requests over the ITL objective (their TPOT)

    def flat(self) -> dict[str, float | None]:
        """The figures a repeat is compared on, by name (the spread between repeats)."""
        out: dict[str, float | None] = {}
        for name, value in self.ttft_s.items():
            out[f"ttft_{name}_s"] = value
        for name, value in self.itl_s.items():
            out[f"itl_{name}_s"] = value
        out.update(output_tps=self.output_tps, total_tps=self.total_tps,
                   concurrency_mean=self.concurrency_mean, goodput_rps=self.goodput_rps,
                   errors=float(self.errors))
        return out


def figures(
    results: Sequence[RequestResult], span_s: float, scale: float = 1.0, slo: Slo | None = None
) -> Figures:
    """A point's figures. Failed requests are counted as errors and left out of every latency
    and every token count; `span_s` is wall time; `scale` turns wall into model time."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s / scale for r in ok if r.ttft_s is not None]
    gaps = [g / scale for r in ok for g in r.gaps_s]
    tpots = [t / scale for r in ok if (t := tpot_s(r)) is not None]
    kinds: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = error_kind(r.error or "unknown")
            kinds[kind] = kinds.get(kind, 0) + 1
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    output = sum(r.output_tokens or 0 for r in ok)
    span = span_s / scale
    busy = sum(max(0, r.ended_ns - r.sent_ns) for r in results) / 1e9 / scale
    met = ttft_over = itl_over = None
    if slo is not None:
        met = sum(1 for r in ok if slo.good(r, scale))
        ttft_over = sum(1 for r in ok if r.ttft_s is None or r.ttft_s / scale > slo.ttft_s)
        itl_over = sum(1 for r in ok if (t := tpot_s(r)) is not None and t / scale > slo.itl_s)

    def per_s(count: float) -> float:
        return count / span if span > 0 else 0.0

    return Figures(
        requests=len(results),
        errors=len(results) - len(ok),
        error_kinds=kinds,
        ttft_s=named_quantiles(ttfts),
        itl_s=named_quantiles(gaps),
        itl_max_s=max(gaps) if gaps else None,
        tpot_p50_s=percentile(sorted(tpots), 0.5),
        tpot_s=named_quantiles(tpots),
        e2e_p50_s=percentile(sorted(r.e2e_s / scale for r in ok), 0.5),
        prompt_tokens=prompt,
        output_tokens=output,
        output_chunks=sum(r.output_events for r in ok),
        span_s=span,
        output_tps=per_s(output),
        total_tps=per_s(prompt + output),
        request_rps=per_s(len(ok)),
        concurrency_mean=busy / span if span > 0 else 0.0,
        concurrency_max=concurrency_max(results),
        goodput_rps=None if met is None else per_s(met),
        slo_requests_met=met,
        slo_attainment=None if met is None or not results else met / len(results),
        slo_ttft_over=ttft_over,
        slo_itl_over=itl_over,
    )


def slo_verdict(fig: Figures, slo: Slo) -> tuple[bool, list[str]]:
    """Whether a point meets the SLO pair (enough good requests, few enough failures), and
    the reasons it does not. `fig` must have been computed with the same `slo`."""
    reasons: list[str] = []
    attained = fig.slo_attainment
    if attained is None or attained < slo.attainment:
        reasons.append(
            f"{fig.slo_requests_met or 0} of {fig.requests} requests good "
            f"({attained or 0:.1%}, needs {slo.attainment:.0%}): {fig.slo_ttft_over or 0} over "
            f"the TTFT objective {slo.ttft_s * 1e3:g} ms, {fig.slo_itl_over or 0} over the ITL "
            f"objective {slo.itl_s * 1e3:g} ms (TPOT), {fig.errors} failed")
    if fig.errors > slo.max_error_rate * fig.requests:
        reasons.append(f"{fig.errors} of {fig.requests} requests failed")
    return not reasons, reasons
