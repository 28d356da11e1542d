"""One bench run from start to end: discover the target, measure, join phasewatch's records.

`run_bench` returns the run as rows (`phasewatch.bench.result`). With a `RunStore` it also
stores the run: a `running` row before the first request, and the points and summary at the end, or
`failed` with the points measured so far when the run breaks off (an error, Ctrl-C).

When the target is phasewatch, every request carries the run id in `x-phasewatch-run-id` and
its own `x-request-id` (`<run id>-<step>-<repeat>-<n>`), so the proxy's records of exactly these
requests are read back (`GET /api/requests?run_id=`) once the run ends, grouped per point, and
kept in each point's `extra["proxy"]` beside the client's figures.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from phasewatch.bench.load import Sender, closed_loop
from phasewatch.bench.modes import MODES, Context, ModeOptions, parameters
from phasewatch.bench.progress import NoProgress, Progress
from phasewatch.bench.prompts import ESTIMATE, PromptBuilder
from phasewatch.bench.proxy_view import proxy_figures, run_records
from phasewatch.bench.result import RunResult
from phasewatch.bench.target import Target, discover
from phasewatch.bench.workload import client_session

if TYPE_CHECKING:
    from phasewatch.bench.storage import RunStore


@dataclass(frozen=True, slots=True)
class BenchOptions:
    url: str
    mode: ModeOptions
    model: str | None = None
    name: str | None = None
    tokenizer: str | None = None  # a local tokenizer.json, for servers without /tokenize
    engine_url: str | None = None  # where the engine's /metrics is, if not the target's
    run_id: str | None = None
    warmup: bool = True


def new_run_id(kind: str) -> str:
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _streams(mode: ModeOptions) -> int:
    """Connections the client should allow: the most streams the mode can have open."""
    if mode.kind == "concurrency":
        return max(getattr(mode, "concurrency", (1,)))
    if mode.kind in ("rate", "goodput"):
        return 1024
    return 8


def _run_row(options: BenchOptions, target: Target, run_id: str, method: str,
             started: datetime) -> dict[str, Any]:
    kind = options.mode.kind
    return {
        "id": run_id,
        "name": options.name or f"{kind} on {target.model}",
        "kind": kind,
        "target": options.url,
        "status": "running",
        "parameters": {
            **parameters(options.mode),
            "model": target.model,
            "prompt_tokens_by": method,  # server, local or estimate (approximate)
            "time_scale": target.time_scale,
            "clock": "model" if target.time_scale != 1 else "wall",
            "itl": "one sample per output-carrying chunk",
        },
        "engine": {**target.engine, "via_phasewatch": target.phasewatch},
        "started_at": started,
        "finished_at": None,
        "summary": None,
    }


async def _join_proxy(ctx: Context) -> dict[str, Any]:
    """Read phasewatch's records of this run and put its figures beside each point's."""
    records = await run_records(ctx.session, ctx.target.url, ctx.run_id, ctx.sent)
    by_id = {r["request_id"]: r for r in records}
    scale = ctx.scale
    if ctx.phase_requests:  # interference: by setting and phase, and the long prompt's own
        for point in ctx.points:
            name, chunked = point["extra"]["phase"], point["extra"]["chunked_prefill"] or ""
            rounds = [ids for ids in ctx.phase_requests if ids["chunked"] == chunked]
            mine = [by_id[i] for ids in rounds for i in ids[name] if i in by_id]
            point["extra"]["proxy"] = proxy_figures(mine, scale)
            if name == "during":
                longs = [by_id[i] for ids in rounds for i in ids["long"] if i in by_id]
                point["extra"]["proxy"]["long_ttft_s"] = proxy_figures(longs, scale)["ttft_s"]
    else:
        grouped: dict[int, list[dict[str, Any]]] = {}
        for record in records:
            found = ctx.prefixes.get(str(record["request_id"]).rsplit("-", 1)[0])
            if found is not None:
                grouped.setdefault(found, []).append(record)
        for point in ctx.points:
            point["extra"]["proxy"] = proxy_figures(grouped.get(point["step"], []), scale)
    return {"records": len(records), "requests_tagged": ctx.sent,
            "upstream": (ctx.target.phasewatch or {}).get("upstream"),
            "version": (ctx.target.phasewatch or {}).get("version")}


async def run_bench(options: BenchOptions, store: RunStore | None = None,
                    progress: Progress | None = None) -> RunResult:
    progress = progress or NoProgress()
    url = options.url.rstrip("/")
    async with client_session(_streams(options.mode)) as session:
        target = await discover(session, url, options.model, options.engine_url)
        prompts = PromptBuilder(session, url, target.model, options.tokenizer)
        method = await prompts.choose()
        run_id = options.run_id or new_run_id(options.mode.kind)
        run = _run_row(options, target, run_id, method, datetime.now(UTC))
        ctx = Context(session, target, run_id, prompts, progress,
                      tag_run=target.phasewatch is not None)
        if store is not None:
            await store.begin(run)
        summary: dict[str, Any] = {}
        try:
            if options.warmup:  # connections and first-call costs stay out of the first point
                warmup = Sender(session, url + "/v1/completions", await ctx.body(16, 4),
                                None, f"{run_id}-warmup")  # no run id: not one of its records
                await closed_loop(warmup, 1, 1)
            summary = await MODES[options.mode.kind](ctx, options.mode)
            if target.phasewatch is not None:
                summary["phasewatch"] = await _join_proxy(ctx)
            if method == ESTIMATE:
                summary["approximate_prompts"] = True
        except BaseException as exc:
            run.update(status="failed", finished_at=datetime.now(UTC),
                       parameters={**run["parameters"], **ctx.resolved},
                       summary={**summary, "error": f"{type(exc).__name__}: {exc}"[:500]})
            if store is not None:
                await store.finish(run, ctx.points)
            raise
        finally:
            progress.stop()
        run.update(status="finished", finished_at=datetime.now(UTC), summary=summary,
                   parameters={**run["parameters"], **ctx.resolved})
        if store is not None:
            await store.finish(run, ctx.points)
    return RunResult(run, ctx.points)
