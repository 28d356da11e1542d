"""The article's two experiments ("Prefill vs Decode", Try It), run through a phasewatch proxy.

Experiment 1 sends one request at a time with prompts of 64/256/1024/4096 tokens and
max_tokens 128; experiment 2 sends 1/4/16/64 requests at once with 256-token prompts. Every
step carries its own `x-phasewatch-run-id`, so phasewatch's stored view of exactly those
requests is read back (`/api/requests`, `/api/stats`) and shown next to the client's.

Against the simulator at `--time-scale S`, wall times are divided by S to give model time (what
a GPU of the preset would show); the report says which scale was used.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from phasewatch.bench.proxy_view import ProxyStats, run_stats, stored_records
from phasewatch.bench.stats import StepStats, summarize
from phasewatch.bench.workload import (
    WorkloadError,
    burst,
    client_session,
    completion_body,
    exact_prompt,
    first_model,
)

PROMPT_SWEEP = (64, 256, 1024, 4096)
CONCURRENCY_SWEEP = (1, 4, 16, 64)
MAX_TOKENS = 128
CONCURRENCY_PROMPT = 256
# The article's indicative table 1 (T4, Qwen2.5-0.5B-Instruct): prompt -> (TTFT ms, ITL ms).
# The article marks it unverified; it gives no numbers for table 2, only the shape.
ARTICLE_TABLE_1 = {64: (41.0, 9.8), 256: (58.0, 9.7), 1024: (119.0, 9.9), 4096: (372.0, 9.8)}
ARTICLE_TABLE_2_SHAPE = (
    "ITL rises far less than proportionally, throughput rises steeply, TTFT rises too"
)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    prompt_sweep: Sequence[int] = PROMPT_SWEEP
    concurrency_sweep: Sequence[int] = CONCURRENCY_SWEEP
    max_tokens: int = MAX_TOKENS
    concurrency_prompt: int = CONCURRENCY_PROMPT
    run_prefix: str = field(default_factory=lambda: time.strftime("demo-%Y%m%d-%H%M%S"))


@dataclass(frozen=True, slots=True)
class Step:
    """One step of an experiment: the client's summary and the proxy's, both in model time."""

    label: int
    run_id: str
    client: StepStats
    proxy: ProxyStats | None


def _scaled(stats: ProxyStats | None, scale: float) -> ProxyStats | None:
    if stats is None:
        return None

    def s(value: float | None) -> float | None:
        return None if value is None else value / scale

    return ProxyStats(stats.requests, stats.errors, s(stats.ttft_p50_s), s(stats.itl_p50_s),
                      s(stats.itl_mean_s))


async def run_step(
    session: aiohttp.ClientSession, proxy_url: str, model: str, prompt: str, max_tokens: int,
    concurrency: int, run_id: str, scale: float, label: int,
) -> Step:
    sent = await burst(session, proxy_url, completion_body(model, prompt, max_tokens),
                       concurrency, run_id)
    await stored_records(session, proxy_url, run_id, concurrency)
    proxy = _scaled(await run_stats(session, proxy_url, run_id), scale)
    return Step(label, run_id, summarize(sent.results, sent.elapsed_s, scale), proxy)


@dataclass(frozen=True, slots=True)
class ArticleRun:
    model: str
    sim: dict[str, Any]  # the simulator's /version summary; empty for a real server
    scale: float  # the simulator's time-scale, read from the simulator; 1 for a real server
    prompt_steps: list[Step]
    concurrency_steps: list[Step]


async def sim_summary(session: aiohttp.ClientSession, sim_url: str) -> dict[str, Any]:
    """The simulator's own account of itself (GPU, model, scheduler limits, time-scale)."""
    async with session.get(sim_url + "/version") as response:
        if response.status != 200:
            raise WorkloadError(f"{sim_url}/version answered {response.status}")
        body = await response.json(loads=orjson.loads)
    summary: dict[str, Any] = body.get("phasewatch_sim") or {}
    return summary


async def measure_article(proxy_url: str, sim_url: str | None, options: DemoOptions) -> ArticleRun:
    async with client_session(max(options.concurrency_sweep)) as session:
        model = await first_model(session, proxy_url)
        sim = await sim_summary(session, sim_url) if sim_url else {}
        # Read from the simulator itself, so the conversion to model time cannot drift from it.
        scale = float(sim.get("time_scale", 1.0))
        prompts = {n: await exact_prompt(session, proxy_url, model, n)
                   for n in {*options.prompt_sweep, options.concurrency_prompt}}
        # One unmeasured request first: connections, the proxy's and the server's first-call
        # costs (imports, caches) should not land in the 64-token row.
        await burst(session, proxy_url, completion_body(model, prompts[options.prompt_sweep[0]],
                                                        4), 1, f"{options.run_prefix}-warmup")
        prompt_steps = [
            await run_step(session, proxy_url, model, prompts[n], options.max_tokens, 1,
                           f"{options.run_prefix}-prompt-{n}", scale, n)
            for n in options.prompt_sweep
        ]
        concurrency_steps = [
            await run_step(session, proxy_url, model, prompts[options.concurrency_prompt],
                           options.max_tokens, c, f"{options.run_prefix}-concurrency-{c}", scale, c)
            for c in options.concurrency_sweep
        ]
    return ArticleRun(model, sim, scale, prompt_steps, concurrency_steps)


async def run_article(proxy_url: str, sim_url: str | None, options: DemoOptions) -> str:
    return render(await measure_article(proxy_url, sim_url, options), options)


def _ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value * 1e3:.{digits}f}"


def render(run: ArticleRun, options: DemoOptions) -> str:
    """The report: both tables, the article's beside them, phasewatch's stored view beside both."""
    scale = run.scale
    lines = [f"model {run.model}"]
    if run.sim:
        lines.append(
            f"server: phasewatch's simulator, a roofline model of {run.sim['gpu']} (no GPU "
            f"used); max_num_seqs {run.sim['max_num_seqs']}, max_num_batched_tokens "
            f"{run.sim['max_num_batched_tokens']}, chunked prefill "
            f"{'on' if run.sim['enable_chunked_prefill'] else 'off'}"
        )
    if scale != 1:
        lines.append(
            f"time-scale {scale:g}: the simulator ran {scale:g}x slower than real time so "
            f"Python's per-chunk costs shrink {scale:g}-fold; every time below is wall time "
            f"/ {scale:g} (model time), throughput x {scale:g}."
        )
    lines += [
        "prompts: 'word ' repeated, each length confirmed exact by the server's /tokenize; "
        f"max_tokens {options.max_tokens} with ignore_eos, temperature 0, /v1/completions.",
        "client: aiohttp stream, TTFT = send -> first chunk with text, ITL = median across "
        "requests of each request's median chunk gap; tokens from usage.",
        "phasewatch: the same requests as the proxy stored them (GET /api/stats?run_id=...): "
        "TTFT p50, ITL p50 (median of per-request p50s).",
        "",
        "Experiment 1: longer prompts, one request at a time",
        f"{'':>8} | {'article (indicative)':^20} | {'client (measured)':^27} | "
        f"{'phasewatch (stored)':^20}",
        f"{'prompt':>8} | {'TTFT ms':>9} {'ITL ms':>9} | {'TTFT ms':>9} {'ITL ms':>9} "
        f"{'tok/s':>7} | {'TTFT ms':>9} {'ITL ms':>9}",
    ]
    for step in run.prompt_steps:
        article = ARTICLE_TABLE_1.get(step.label)
        a_ttft, a_itl = (f"{article[0]:.0f}", f"{article[1]:.1f}") if article else ("-", "-")
        c, p = step.client, step.proxy
        lines.append(
            f"{step.label:>8} | {a_ttft:>9} {a_itl:>9} | {_ms(c.ttft_p50_s):>9} "
            f"{_ms(c.itl_p50_s, 2):>9} {c.throughput_tps:>7.0f} | "
            f"{_ms(p.ttft_p50_s if p else None):>9} {_ms(p.itl_p50_s if p else None, 2):>9}"
            + (f"  ({c.errors} errors)" if c.errors else "")
        )
    lines += [
        "",
        f"Experiment 2: more concurrent users, {options.concurrency_prompt}-token prompts "
        "sent together",
        f"article (no numbers, the shape): {ARTICLE_TABLE_2_SHAPE}",
        f"{'':>8} | {'client (measured)':^38} | {'phasewatch (stored)':^20}",
        f"{'streams':>8} | {'TTFT ms':>9} {'ITL ms':>9} {'tok/s':>7} {'errors':>9} | "
        f"{'TTFT ms':>9} {'ITL ms':>9}",
    ]
    for step in run.concurrency_steps:
        c, p = step.client, step.proxy
        lines.append(
            f"{step.label:>8} | {_ms(c.ttft_p50_s):>9} {_ms(c.itl_p50_s, 2):>9} "
            f"{c.throughput_tps:>7.0f} {c.errors:>9} | "
            f"{_ms(p.ttft_p50_s if p else None):>9} {_ms(p.itl_p50_s if p else None, 2):>9}"
        )
    lines += ["", *shape_lines(run)]
    lines.append(
        "throughput = output tokens / wall-clock span of the step (first send -> last byte)"
        + (f", x {scale:g}" if scale != 1 else "")
        + f". Requests carry run ids {options.run_prefix}-prompt-N and"
        + f" {options.run_prefix}-concurrency-N (GET /api/requests?run_id=...)."
    )
    return "\n".join(lines)


def shape_lines(run: ArticleRun) -> list[str]:
    """The measured ratios that make the article's shape claims checkable at a glance."""
    out: list[str] = []
    p, c = run.prompt_steps, run.concurrency_steps
    if len(p) >= 2 and all(s.client.ttft_p50_s and s.client.itl_p50_s for s in (p[0], p[-1])):
        itls = [s.client.itl_p50_s for s in p if s.client.itl_p50_s]
        out.append(
            f"prompt {p[0].label} -> {p[-1].label} tokens ({p[-1].label / p[0].label:.0f}x): "
            f"TTFT x{_ratio(p[-1].client.ttft_p50_s, p[0].client.ttft_p50_s)}, "
            f"ITL within {(max(itls) / min(itls) - 1) * 100:.1f}% (min to max)"
        )
    if len(c) >= 2:
        first, last = c[0].client, c[-1].client
        out.append(
            f"streams {c[0].label} -> {c[-1].label} ({c[-1].label / c[0].label:.0f}x): "
            f"ITL x{_ratio(last.itl_p50_s, first.itl_p50_s)}, "
            f"throughput x{_ratio(last.throughput_tps, first.throughput_tps)}, "
            f"TTFT x{_ratio(last.ttft_p50_s, first.ttft_p50_s)}"
        )
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"
