"""The bench's five experiments, each a function from options to measured points (no storage).

- `prompt`: longer prompts at a fixed output length (the article's first table);
- `concurrency`: more streams at once at a fixed prompt length (the second table);
- `interference`: one client streams short prompts back to back while a long prompt arrives;
  that client's ITL before, during and after the long prefill, with the simulator's chunked
  prefill as it is, on, off, or both in turn (`sim_control`); the long prompt is sized from the
  server's `max_num_batched_tokens` (`long_prompt`);
- `rate`: open-loop Poisson arrivals at each rate of a list;
- `goodput`: the highest Poisson rate at which enough requests meet an SLO pair (`stats.Slo`:
  one per-request definition, for the verdict and for goodput alike): the rate doubles until a
  step misses, then the gap between the last pass and the first miss is bisected.

Every duration and rate is on the model's clock: against phasewatch's simulator at
`--time-scale S`, wall times are divided by S, and schedules (arrival offsets, the
interference's waits) are stretched S-fold in wall time. Repeats of a sweep are interleaved
(every point once, then again), so a drift of the machine spreads over all points, and a
point's figures are pooled over its repeats while each repeat's own are kept for the spread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from time import monotonic_ns
from typing import Any

import aiohttp

from phasewatch.bench.client import RequestResult
from phasewatch.bench.errors import WorkloadError
from phasewatch.bench.load import Batch, Sender, closed_loop, open_loop, poisson_offsets
from phasewatch.bench.long_prompt import size_long_prompt
from phasewatch.bench.progress import Progress
from phasewatch.bench.prompts import PromptBuilder
from phasewatch.bench.result import point_row, spread
from phasewatch.bench.sim_control import VARIANTS, require_simulator, set_chunked_prefill
from phasewatch.bench.stats import Figures, Slo, figures, named_quantiles, slo_verdict
from phasewatch.bench.target import Target
from phasewatch.bench.workload import completion_body


@dataclass(frozen=True, slots=True)
class PromptSweep:
    prompt_tokens: tuple[int, ...] = (64, 256, 1024, 4096)
    max_tokens: int = 128
    requests: int = 3  # per point and repeat
    concurrency: int = 1
    repeats: int = 1
    kind: str = "prompt"


@dataclass(frozen=True, slots=True)
class ConcurrencySweep:
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    prompt_tokens: int = 256
    max_tokens: int = 128
    requests_per_stream: int = 1  # each stream sends this many back to back
    repeats: int = 1
    kind: str = "concurrency"


@dataclass(frozen=True, slots=True)
class Interference:
    short_prompt_tokens: int = 64
    # Long enough that one short request spans before_s + the long prefill + after_s; else the
    # stall can land in the next short request's TTFT instead of an ITL gap.
    short_max_tokens: int = 256
    long_prompt_tokens: int | None = None  # None: sized from the server's budget (long_prompt)
    long_max_tokens: int = 4
    before_s: float = 0.5  # the short client streams alone this long first (model seconds)
    after_s: float = 0.5  # and goes on this long after the long prompt's first token
    chunked_prefill: str = "as-is"  # as-is, or on, off, both: the simulator's switch
    repeats: int = 1
    kind: str = "interference"


@dataclass(frozen=True, slots=True)
class RateSweep:
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    requests: int = 100  # Poisson arrivals per point and repeat
    prompt_tokens: int = 256
    max_tokens: int = 128
    slo: Slo | None = None  # for the goodput column
    seed: int = 0
    repeats: int = 1
    kind: str = "rate"


@dataclass(frozen=True, slots=True)
class GoodputSearch:
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=0.5, itl_s=0.04))
    start_rate: float = 1.0
    max_rate: float = 256.0
    bisect_steps: int = 4
    tolerance: float = 0.05  # stop bisecting once (miss - pass) / pass is under this
    requests: int = 100
    prompt_tokens: int = 256
    max_tokens: int = 128
    seed: int = 0
    repeats: int = 1
    kind: str = "goodput"


ModeOptions = PromptSweep | ConcurrencySweep | Interference | RateSweep | GoodputSearch


def parameters(options: ModeOptions) -> dict[str, Any]:
    """The options as stored with the run (the SLO in seconds, by name)."""
    out = dataclasses.asdict(options)
    for key, value in list(out.items()):
        if isinstance(value, tuple):
            out[key] = list(value)
    return out


@dataclass(slots=True)
class Context:
    """What every experiment needs: where to send, how to build prompts, and the run's tags."""

    session: aiohttp.ClientSession
    target: Target
    run_id: str
    prompts: PromptBuilder
    progress: Progress
    tag_run: bool = True  # send x-phasewatch-run-id
    points: list[dict[str, Any]] = field(default_factory=list)  # finished, in order
    prefixes: dict[str, int] = field(default_factory=dict)  # request id prefix -> step
    # interference: per round, its chunked-prefill setting ("chunked": "on", "off" or "") and
    # the request ids of each phase ("long": the long prompt's)
    phase_requests: list[dict[str, Any]] = field(default_factory=list)
    sent: int = 0  # requests sent with the run id
    resolved: dict[str, Any] = field(default_factory=dict)  # options settled while measuring

    @property
    def scale(self) -> float:
        return self.target.time_scale

    def sender(self, prefix: str, body: dict[str, Any], step: int | None = None) -> Sender:
        full = f"{self.run_id}-{prefix}"
        if step is not None:
            self.prefixes[full] = step
        return Sender(self.session, self.target.url + "/v1/completions", body,
                      self.run_id if self.tag_run else None, full)

    def count(self, batch: Batch) -> Batch:
        self.sent += len(batch.results)
        return batch

    async def body(self, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
        prompt = await self.prompts.prompt(prompt_tokens)
        return completion_body(self.target.model, prompt.text, max_tokens)


Summary = dict[str, Any]


def _pooled(batches: Sequence[Batch], scale: float, slo: Slo | None = None) -> Figures:
    results = [r for b in batches for r in b.results]
    return figures(results, sum(b.span_s for b in batches), scale, slo)


async def _sweep(
    ctx: Context, x_name: str, xs: Sequence[float], repeats: int,
    run_one: Callable[[int, float, int], Awaitable[Batch]],
    extra: Callable[[int, float, list[Batch]], dict[str, Any]], slo: Slo | None = None,
) -> None:
    """Every x once per repeat, repeats interleaved; each point pooled over its repeats so far
    (so a run that breaks off keeps what it measured)."""
    batches: list[list[Batch]] = [[] for _ in xs]
    for repeat in range(repeats):
        for step, x in enumerate(xs):
            batches[step].append(ctx.count(await run_one(step, x, repeat)))
            per_repeat = [figures(b.results, b.span_s, ctx.scale, slo) for b in batches[step]]
            point = point_row(step, x_name, x, _pooled(batches[step], ctx.scale, slo),
                              per_repeat, extra(step, x, batches[step]))
            if step < len(ctx.points):
                ctx.points[step] = point
            else:
                ctx.points.append(point)
            ctx.progress.advance(f"{x_name} {x:g}, repeat {repeat + 1} of {repeats}")


async def prompt_sweep(ctx: Context, o: PromptSweep) -> Summary:
    ctx.progress.start(len(o.prompt_tokens) * o.repeats, "prompt-length sweep")
    bodies = {n: await ctx.body(n, o.max_tokens) for n in o.prompt_tokens}

    async def one(step: int, x: float, repeat: int) -> Batch:
        sender = ctx.sender(f"{step}-{repeat}", bodies[int(x)], step)
        return await closed_loop(sender, o.concurrency, o.requests)

    await _sweep(ctx, "prompt_tokens", o.prompt_tokens, o.repeats, one, lambda *_: {})
    return {}


async def concurrency_sweep(ctx: Context, o: ConcurrencySweep) -> Summary:
    ctx.progress.start(len(o.concurrency) * o.repeats, "concurrency sweep")
    body = await ctx.body(o.prompt_tokens, o.max_tokens)

    async def one(step: int, x: float, repeat: int) -> Batch:
        c = int(x)
        sender = ctx.sender(f"{step}-{repeat}", body, step)
        return await closed_loop(sender, c, c * o.requests_per_stream)

    await _sweep(ctx, "concurrency", o.concurrency, o.repeats, one, lambda *_: {})
    return {}


def _lateness(batches: Sequence[Batch], scale: float) -> float | None:
    late = sorted(n for b in batches for n in b.lateness_ns)
    return named_quantiles([n / 1e9 / scale for n in late])["p99"]


async def _rate_step(
    ctx: Context, step: int, rate: float, o: RateSweep | GoodputSearch, repeat: int,
    body: dict[str, Any],
) -> Batch:
    offsets = [t * ctx.scale for t in poisson_offsets(rate, o.requests, o.seed + repeat)]
    return await open_loop(ctx.sender(f"{step}-{repeat}", body, step), offsets)


def _slo_row(slo: Slo) -> dict[str, Any]:
    """The SLO as stored with the run, with how it was judged (runs stored before this
    definition judged quantiles of TTFT and of per-chunk ITL instead)."""
    return {**dataclasses.asdict(slo), "judged": "per request, as vllm bench serve --goodput"}


def _rate_extra(batches: Sequence[Batch], scale: float, slo: Slo | None) -> dict[str, Any]:
    pooled = _pooled(batches, scale, slo)
    extra: dict[str, Any] = {"send_lateness_p99_s": _lateness(batches, scale)}
    if slo is not None:
        passed, reasons = slo_verdict(pooled, slo)
        extra.update(slo_met=passed, slo_misses=reasons)
    return extra


async def rate_sweep(ctx: Context, o: RateSweep) -> Summary:
    ctx.progress.start(len(o.rates) * o.repeats, "request-rate sweep (Poisson arrivals)")
    body = await ctx.body(o.prompt_tokens, o.max_tokens)

    async def one(step: int, x: float, repeat: int) -> Batch:
        return await _rate_step(ctx, step, x, o, repeat, body)

    await _sweep(ctx, "rate", o.rates, o.repeats, one,
                 lambda _s, _x, b: _rate_extra(b, ctx.scale, o.slo), o.slo)
    return {"slo": _slo_row(o.slo)} if o.slo else {}


@dataclass(slots=True)
class _Search:
    """Where the goodput search stands; `next_rate` is its one rule (pure)."""

    o: GoodputSearch
    passed: float | None = None  # the highest rate that met the SLO
    missed: float | None = None  # the lowest rate above it that did not
    bisections: int = 0

    def record(self, rate: float, met: bool) -> None:
        if self.missed is not None:
            self.bisections += 1
        if met:
            self.passed = rate
        else:
            self.missed = rate

    def next_rate(self) -> float | None:
        """Double while every rate passes; after the first miss, bisect; None: done."""
        o = self.o
        if self.missed is None:
            rate = o.start_rate if self.passed is None else self.passed * 2
            return rate if rate <= o.max_rate else None
        if self.passed is None or self.bisections >= o.bisect_steps:
            return None
        if (self.missed - self.passed) / self.passed <= o.tolerance:
            return None
        return round((self.passed + self.missed) / 2, 6)

    def most_left(self) -> int:
        """The most trials the search can still make (the doublings left, then bisections)."""
        o = self.o
        if self.missed is not None:
            return o.bisect_steps - self.bisections
        rate = o.start_rate if self.passed is None else self.passed * 2
        doublings = 0
        while rate <= o.max_rate:
            doublings, rate = doublings + 1, rate * 2
        return doublings + o.bisect_steps


async def goodput_search(ctx: Context, o: GoodputSearch) -> Summary:
    """Double the rate until a step misses the SLO pair, then bisect between pass and miss.

    Progress counts trials (x repeats): the total is "at most" what is left until the search
    knows its last trial, and exact from then, so the count it ends on is the one it shows."""
    if o.start_rate > o.max_rate:
        raise WorkloadError(f"the start rate {o.start_rate:g} is above the max rate {o.max_rate:g}")
    search = _Search(o)
    ctx.progress.start(search.most_left() * o.repeats, f"goodput search: {o.slo.describe()}",
                       at_most=True)
    body = await ctx.body(o.prompt_tokens, o.max_tokens)
    rate = search.next_rate()
    while rate is not None:
        step = len(ctx.points)
        batches = []
        for repeat in range(o.repeats):
            batches.append(ctx.count(await _rate_step(ctx, step, rate, o, repeat, body)))
            if repeat < o.repeats - 1:
                ctx.progress.advance(f"rate {rate:g}, repeat {repeat + 1} of {o.repeats}")
        per_repeat = [figures(b.results, b.span_s, ctx.scale, o.slo) for b in batches]
        extra = _rate_extra(batches, ctx.scale, o.slo)
        ctx.points.append(point_row(step, "rate", rate, _pooled(batches, ctx.scale, o.slo),
                                    per_repeat, extra))
        search.record(rate, bool(extra["slo_met"]))
        tried = rate
        rate = search.next_rate()
        done = len(ctx.points) * o.repeats
        if rate is None:
            ctx.progress.revise(done, at_most=False)
        else:
            ctx.progress.revise(done + search.most_left() * o.repeats, at_most=True)
        ctx.progress.advance(f"rate {tried:g}, repeat {o.repeats} of {o.repeats}")
    best = next((p for p in ctx.points if p["x_value"] == search.passed), None)
    return {
        "slo": _slo_row(o.slo),
        "best_rate": search.passed,
        "next_rate": search.missed,
        "best_step": best["step"] if best else None,
        "next_step": next((p["step"] for p in ctx.points if p["x_value"] == search.missed),
                          None),
        "goodput_rps": best["goodput_rps"] if best else None,
    }


# -- interference ---------------------------------------------------------------------------------

PHASES = ("before", "during", "after")


@dataclass(slots=True)
class _Round:
    shorts: list[RequestResult]
    long: RequestResult
    long_first_ns: int  # the long prompt's first token (its end, if it produced none)
    stop_ns: int


async def _interference_round(ctx: Context, o: Interference, tag: str,
                              short_body: dict[str, Any], long_body: dict[str, Any]) -> _Round:
    short = ctx.sender(f"short-{tag}", short_body)
    long = ctx.sender(f"long-{tag}", long_body)
    stop = asyncio.Event()
    streaming = asyncio.Event()
    short.trace = lambda _now, _data: streaming.set()
    shorts: list[RequestResult] = []

    async def stream_shorts() -> None:
        while not stop.is_set():
            shorts.append(await short.send())
            if not shorts[-1].ok and not streaming.is_set():
                streaming.set()  # it never streamed: stop waiting for it
                return

    task = asyncio.create_task(stream_shorts())
    try:
        # Counted from the short stream's first token, so the long prompt lands mid-stream
        # (when the short request is long enough) rather than in its next request's queue.
        await streaming.wait()
        if shorts and not shorts[0].ok:
            raise WorkloadError(f"the short client's first request failed: {shorts[0].error}")
        await asyncio.sleep(o.before_s * ctx.scale)
        result = await long.send()
        first = (result.sent_ns + int(result.ttft_s * 1e9) if result.ttft_s is not None
                 else result.ended_ns)
        wait_ns = first + int(o.after_s * ctx.scale * 1e9) - monotonic_ns()
        if wait_ns > 0:
            await asyncio.sleep(wait_ns / 1e9)
        stop_ns = monotonic_ns()
        stop.set()
        await task  # the short request in flight finishes normally
    finally:
        stop.set()
        if not task.done():
            task.cancel()
    ctx.sent += len(shorts) + 1
    return _Round(shorts, result, first, stop_ns)


def _phase_of(start_ns: int, end_ns: int, window: tuple[int, int]) -> int:
    """0 before the long prompt arrived, 1 overlapping its prefill, 2 after its first token."""
    if end_ns <= window[0]:
        return 0
    if start_ns >= window[1]:
        return 2
    return 1


def _round_phases(r: _Round, scale: float) -> list[dict[str, Any]]:
    """Per phase: the short client's gaps, its requests' TTFTs, and its errors."""
    window = (r.long.sent_ns, r.long_first_ns)
    phases: list[dict[str, Any]] = [
        {"gaps": [], "ttfts": [], "requests": set(), "errors": 0} for _ in PHASES
    ]
    for index, result in enumerate(r.shorts):
        sent_phase = phases[_phase_of(result.sent_ns, result.sent_ns, window)]
        if not result.ok:
            sent_phase["errors"] += 1
            continue
        if result.ttft_s is not None:
            sent_phase["ttfts"].append(result.ttft_s / scale)
        stamps = result.output_ns
        for a, b in pairwise(stamps):
            phase = phases[_phase_of(a, b, window)]
            phase["gaps"].append((b - a) / 1e9 / scale)
            phase["requests"].add(index)
    return phases


def _phase_flat(gaps: list[float]) -> dict[str, float | None]:
    flat = {f"itl_{k}_s": v for k, v in named_quantiles(gaps).items()}
    flat["itl_max_s"] = max(gaps) if gaps else None
    return flat


def _timeline(r: _Round, scale: float, chunked: str | None) -> dict[str, Any]:
    """The short client's gaps against time, in model seconds from the long prompt's arrival."""
    origin = r.long.sent_ns

    def t(ns: int) -> float:
        return round((ns - origin) / 1e9 / scale, 6)

    return {
        "chunked_prefill": chunked,
        "long_sent_s": 0.0,
        "long_first_token_s": t(r.long_first_ns),
        "long_ttft_s": None if r.long.ttft_s is None else r.long.ttft_s / scale,
        "long_ok": r.long.ok,
        "gaps": [[t(b), round((b - a) / 1e9 / scale, 6)]
                 for s in r.shorts if s.ok for a, b in pairwise(s.output_ns)],
    }


def _on_off(setting: bool | None) -> str | None:
    return None if setting is None else ("on" if setting else "off")


def _phase_points(ctx: Context, first_step: int, chunked: str | None, budget: int | None,
                  rounds: Sequence[_Round]) -> list[dict[str, Any]]:
    """The three phases of one chunked-prefill setting, pooled over its rounds."""
    per_round = [_round_phases(r, ctx.scale) for r in rounds]
    points = []
    for index, name in enumerate(PHASES):
        gaps = [g for phases in per_round for g in phases[index]["gaps"]]
        ttfts = [t for phases in per_round for t in phases[index]["ttfts"]]
        requests = sum(len(phases[index]["requests"]) + phases[index]["errors"]
                       for phases in per_round)
        repeats = [_phase_flat(phases[index]["gaps"]) for phases in per_round]
        points.append({
            "step": first_step + index, "x_name": "phase", "x_value": float(index),
            "requests": requests,
            "errors": sum(phases[index]["errors"] for phases in per_round),
            "concurrency": None,
            **{f"ttft_{k}_s": v for k, v in named_quantiles(ttfts).items()},
            **{f"itl_{k}_s": v for k, v in named_quantiles(gaps).items()},
            "output_throughput_tps": None, "total_throughput_tps": None, "goodput_rps": None,
            "extra": {"phase": name, "chunked_prefill": chunked,
                      "max_num_batched_tokens": budget, "gaps": len(gaps),
                      "itl_max_s": max(gaps) if gaps else None,
                      "repeats": repeats, "spread": spread(repeats)},
        })
    return points


def _phase_ids(r: _Round, chunked: str | None) -> dict[str, Any]:
    """The request ids of one round, by phase, for phasewatch's records of them."""
    window = (r.long.sent_ns, r.long_first_ns)
    ids: dict[str, Any] = {name: [] for name in PHASES}
    for s in r.shorts:
        ids[PHASES[_phase_of(s.sent_ns, s.ended_ns, window)]].append(s.request_id or "")
    ids["long"] = [r.long.request_id or ""]
    ids["chunked"] = chunked or ""
    return ids


def _variant_summary(chunked: str | None, budget: int | None, points: Sequence[dict[str, Any]],
                     rounds: Sequence[_Round], scale: float) -> dict[str, Any]:
    before, during, after = points
    ttfts = [r.long.ttft_s / scale for r in rounds if r.long.ttft_s is not None]
    return {"chunked_prefill": chunked, "max_num_batched_tokens": budget,
            "long_ttft_s": named_quantiles(ttfts)["p50"],
            "long_errors": sum(1 for r in rounds if not r.long.ok),
            "itl_p50_before_s": before["itl_p50_s"],
            "stall_s": during["extra"]["itl_max_s"], "itl_p50_after_s": after["itl_p50_s"]}


async def interference(ctx: Context, o: Interference) -> Summary:
    """Each chunked-prefill setting asked for in turn (the simulator's switch; as the server
    runs when "as-is"), `repeats` rounds each; the setting found is put back at the end."""
    target = ctx.target
    require_simulator(target, o.chunked_prefill)
    variants = VARIANTS[o.chunked_prefill]
    found = target.chunked_prefill
    budget, chunked = target.batched_tokens, found
    switched = False
    try:
        if o.chunked_prefill != "as-is":  # the budget chunks are cut to: the one with it on
            switched = True
            budget = (await set_chunked_prefill(ctx.session, target, True))[
                "max_num_batched_tokens"]
            chunked = True
        plan = size_long_prompt(o.long_prompt_tokens, budget, chunked, target.max_model_len,
                                o.long_max_tokens)
        ctx.resolved["long_prompt_tokens"] = plan.tokens
        ctx.progress.start(len(variants) * o.repeats,
                           "interference: a long prompt against a short stream")
        short_body = await ctx.body(o.short_prompt_tokens, o.short_max_tokens)
        long_body = await ctx.body(plan.tokens, o.long_max_tokens)
        summaries, timelines, all_rounds = [], [], []
        for index, setting in enumerate(variants):
            step_budget = target.batched_tokens
            if setting is not None:
                step_budget = (await set_chunked_prefill(ctx.session, target, setting))[
                    "max_num_batched_tokens"]
            label = _on_off(found if setting is None else setting)
            rounds = []
            for repeat in range(o.repeats):
                tag = f"{label}-{repeat}" if setting is not None else f"{repeat}"
                rounds.append(await _interference_round(ctx, o, tag, short_body, long_body))
                what = f"chunked prefill {label}, " if setting is not None else ""
                ctx.progress.advance(f"{what}repeat {repeat + 1} of {o.repeats}")
            points = _phase_points(ctx, 3 * index, label, step_budget, rounds)
            ctx.points.extend(points)
            ctx.phase_requests.extend(_phase_ids(r, label) for r in rounds)
            summaries.append(_variant_summary(label, step_budget, points, rounds, ctx.scale))
            timelines += [_timeline(r, ctx.scale, label) for r in rounds]
            all_rounds += rounds
    finally:
        if switched and found is not None:
            with contextlib.suppress(WorkloadError, aiohttp.ClientError, TimeoutError):
                await set_chunked_prefill(ctx.session, target, found)
    long_ttfts = [r.long.ttft_s / ctx.scale for r in all_rounds if r.long.ttft_s is not None]
    return {
        "long_prompt_tokens": plan.tokens,
        "long_prompt": plan.how,
        "same_step": plan.same_step,
        "long_ttft_s": named_quantiles(long_ttfts)["p50"],
        "long_errors": sum(1 for r in all_rounds if not r.long.ok),
        "variants": summaries,
        "timelines": timelines,
    }


MODES: dict[str, Callable[[Context, Any], Awaitable[Summary]]] = {
    "prompt": prompt_sweep,
    "concurrency": concurrency_sweep,
    "interference": interference,
    "rate": rate_sweep,
    "goodput": goodput_search,
}
