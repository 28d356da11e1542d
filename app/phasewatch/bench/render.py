"""The terminal report of a run, rendered from its rows alone (pure: no I/O, no clock).

A header says what was measured and how (target, engine, clock, how prompts were counted), a
table has one row per point (the client's figures, then phasewatch's for the same requests when
the run went through it), and a few lines give the ratios behind the article's claims. The same
rows give the same text whether they come from the run itself, its JSON export or the database.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]
# The labels of vLLM's `cache_config_info` worth a line in the header (all of them are stored).
CACHE_KEYS = ("block_size", "num_gpu_blocks", "kv_cache_size_tokens", "cache_dtype",
              "gpu_memory_utilization", "enable_prefix_caching")


@dataclass(frozen=True, slots=True)
class Column:
    group: str
    name: str
    cell: Callable[[Row], str]
    left: bool = False  # text columns read better left-aligned; figures right-aligned


def ms(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value * 1e3:.{digits}f}"


def num(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _get(row: Row, *path: str) -> Any:
    value: Any = row
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def table(columns: Sequence[Column], rows: Sequence[Row]) -> list[str]:
    """Right-aligned columns under a group line and a name line; groups apart by ` | `."""
    cells = [[c.cell(row) for c in columns] for row in rows]
    widths = [max([len(c.name)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    spans: list[tuple[str, list[int]]] = []
    for i, column in enumerate(columns):
        if spans and spans[-1][0] == column.group:
            spans[-1][1].append(i)
        else:
            spans.append((column.group, [i]))

    def cell(i: int, text: str) -> str:
        return text.ljust(widths[i]) if columns[i].left else text.rjust(widths[i])

    def line(values: Sequence[str]) -> str:
        parts = [" ".join(cell(i, values[i]) for i in idx) for _, idx in spans]
        return " | ".join(parts).rstrip()

    group_cells = []
    for group, idx in spans:
        width = sum(widths[i] for i in idx) + len(idx) - 1
        group_cells.append(group.center(width))
    return [" | ".join(group_cells).rstrip(), line([c.name for c in columns]),
            *(line(r) for r in cells)]


def _figure(key: str, digits: int) -> Callable[[Row], str]:
    return lambda r: ms(r.get(key), digits)


def _quantile_columns(group: str, prefix: str, digits: int) -> list[Column]:
    return [Column(group, q, _figure(f"{prefix}_{q}_s", digits))
            for q in ("p50", "p90", "p95", "p99")]


def point_label(point: Row) -> str:
    """How a point is named in reports and comparisons: `prompt_tokens 1024`, or an
    interference phase by name (`during`, `during, chunked prefill off`)."""
    extra = point.get("extra") or {}
    if point["x_name"] == "phase" and extra.get("phase"):
        chunked = extra.get("chunked_prefill")
        return str(extra["phase"]) + (f", chunked prefill {chunked}" if chunked else "")
    return f"{point['x_name']} {point['x_value']:g}"


def _x_column(kind: str, approximate: bool) -> Column:
    names = {"prompt": ("prompt", "~tokens" if approximate else "tokens"),
             "concurrency": ("asked", "streams"), "rate": ("rate", "req/s"),
             "goodput": ("rate", "req/s")}
    group, name = names.get(kind, ("x", "value"))
    return Column(group, name, lambda r: f"{r['x_value']:g}")


def _point_columns(run: Row, points: Sequence[Row]) -> list[Column]:
    kind = run["kind"]
    approximate = run["parameters"].get("prompt_tokens_by") == "estimate"
    columns = [
        _x_column(kind, approximate),
        Column("requests", "sent", lambda r: str(r["requests"])),
        Column("requests", "errors", lambda r: str(r["errors"])),
        Column("requests", "conc", lambda r: num(r["concurrency"], 1)),
        *_quantile_columns("TTFT ms", "ttft", 1),
        *_quantile_columns("ITL ms", "itl", 2),
        Column("throughput tok/s", "output", lambda r: num(r["output_throughput_tps"])),
        Column("throughput tok/s", "total", lambda r: num(r["total_throughput_tps"])),
    ]
    if kind in ("rate", "goodput") and any(p["goodput_rps"] is not None for p in points):
        q = _get(run, "summary", "slo", "quantile") or "p95"
        columns += [
            Column("SLO (per request)", f"TPOT {q}",
                   lambda r: ms(_get(r, "extra", "figures", "tpot_s", q), 2)),
            Column("SLO (per request)", "good %", lambda r: _percent(
                _get(r, "extra", "figures", "slo_attainment"))),
            Column("SLO (per request)", "goodput", lambda r: num(r["goodput_rps"], 2)),
            Column("SLO (per request)", "met", lambda r: {True: "yes", False: "no"}.get(
                _get(r, "extra", "slo_met"), "-")),
        ]
    if any(_get(p, "extra", "spread") for p in points):
        columns += [
            Column("repeat spread ms", "TTFT p50",
                   lambda r: ms(_get(r, "extra", "spread", "ttft_p50_s"), 1)),
            Column("repeat spread ms", "ITL p50",
                   lambda r: ms(_get(r, "extra", "spread", "itl_p50_s"), 2)),
        ]
    if any(_get(p, "extra", "proxy") for p in points):
        columns += [
            Column("phasewatch (stored)", "reqs",
                   lambda r: num(_get(r, "extra", "proxy", "requests"))),
            Column("phasewatch (stored)", "TTFT p50",
                   lambda r: ms(_get(r, "extra", "proxy", "ttft_s", "p50"), 1)),
            Column("phasewatch (stored)", "ITL p50",
                   lambda r: ms(_get(r, "extra", "proxy", "itl_p50_s", "p50"), 2)),
        ]
    return columns


def _percent(value: Any) -> str:
    return "-" if value is None else f"{value * 100:.1f}"


def _interference_columns(points: Sequence[Row]) -> list[Column]:
    chunked = [Column("short client", "chunked prefill",
                      lambda r: str(_get(r, "extra", "chunked_prefill")), left=True)
               ] if any(_get(p, "extra", "chunked_prefill") for p in points) else []
    columns = [
        Column("short client", "phase", lambda r: str(_get(r, "extra", "phase")), left=True),
        *chunked,
        Column("short client", "requests", lambda r: str(r["requests"])),
        Column("short client", "errors", lambda r: str(r["errors"])),
        Column("short client", "gaps", lambda r: str(_get(r, "extra", "gaps"))),
        *_quantile_columns("its ITL ms", "itl", 2),
        Column("its ITL ms", "max", lambda r: ms(_get(r, "extra", "itl_max_s"), 2)),
        Column("its TTFT ms", "p50", lambda r: ms(r["ttft_p50_s"], 1)),
    ]
    if any(_get(p, "extra", "spread") for p in points):
        columns.append(Column("repeat spread ms", "ITL max",
                              lambda r: ms(_get(r, "extra", "spread", "itl_max_s"), 2)))
    if any(_get(p, "extra", "proxy") for p in points):
        columns += [
            Column("phasewatch (stored)", "reqs",
                   lambda r: num(_get(r, "extra", "proxy", "requests"))),
            Column("phasewatch (stored)", "ITL p50",
                   lambda r: ms(_get(r, "extra", "proxy", "itl_p50_s", "p50"), 2)),
            Column("phasewatch (stored)", "ITL max",
                   lambda r: ms(_get(r, "extra", "proxy", "itl_max_s"), 2)),
        ]
    return columns


def _header(run: Row) -> list[str]:
    p, engine = run["parameters"], run["engine"] or {}
    lines = [f"run {run['id']}  ({run['kind']}, {run['status']})  {run['name']}"]
    via = engine.get("via_phasewatch")
    target = f"target {run['target']}, model {p.get('model')}"
    if via:
        target += f" (through phasewatch {via.get('version')} to {via.get('upstream')})"
    lines.append(target)
    sim = engine.get("sim")
    described = []
    if engine.get("version"):
        described.append(f"version {engine['version']}")
    if engine.get("max_model_len"):
        described.append(f"max_model_len {engine['max_model_len']}")
    if sim:
        described.append(
            f"phasewatch simulator of {sim.get('gpu')} + {sim.get('model')}, max_num_seqs "
            f"{sim.get('max_num_seqs')}, max_num_batched_tokens "
            f"{sim.get('max_num_batched_tokens')}, chunked prefill "
            f"{'on' if sim.get('enable_chunked_prefill') else 'off'}")
    scheduler = engine.get("scheduler")
    if scheduler and not sim:
        chunked = {True: "on", False: "off"}.get(scheduler.get("enable_chunked_prefill"), "?")
        described.append(f"max_num_batched_tokens {scheduler.get('max_num_batched_tokens')}, "
                         f"chunked prefill {chunked} (from {scheduler.get('from')})")
    cache = engine.get("cache_config")
    if cache:
        shown = [f"{key} {cache[key]}" for key in CACHE_KEYS if key in cache]
        described.append("KV cache " + ", ".join(shown or ["(see engine.cache_config)"]))
    if described:
        lines.append("engine: " + "; ".join(described))
    scale = p.get("time_scale", 1.0)
    if scale != 1:
        lines.append(f"clock: model time. The simulator ran {scale:g}x slower than real time; "
                     f"every time is wall / {scale:g}, every rate wall x {scale:g}.")
    method = p.get("prompt_tokens_by")
    lines.append({
        "server": "prompts: exact token counts, by the server's /tokenize",
        "local": "prompts: exact token counts, by a local tokenizer",
        "estimate": "prompts: APPROXIMATE lengths (1 token per word): the server has no "
                    "/tokenize and no local tokenizer was found",
    }.get(str(method), f"prompts: counted by {method}"))
    lines.append(_workload(run))
    return lines


def _workload(run: Row) -> str:
    p, kind = run["parameters"], run["kind"]
    repeats = f"{p.get('repeats', 1)} repeat(s), interleaved"
    if kind == "prompt":
        what = (f"{p['requests']} requests per point, {p['concurrency']} at a time, "
                f"max_tokens {p['max_tokens']}")
    elif kind == "concurrency":
        what = (f"N streams sent together, {p['requests_per_stream']} request(s) each, "
                f"{p['prompt_tokens']}-token prompts, max_tokens {p['max_tokens']}")
    elif kind == "interference":
        chunked = p.get("chunked_prefill", "as-is")
        tokens = p.get("long_prompt_tokens")  # None only if the run broke off before sizing it
        what = (f"a short client ({p['short_prompt_tokens']}-token prompts, max_tokens "
                f"{p['short_max_tokens']}, back to back) streams {p['before_s']:g} s alone from "
                f"its first token, then a {tokens or 'not yet sized'}-token prompt (max_tokens "
                f"{p['long_max_tokens']}) arrives; {p['after_s']:g} s more after its first "
                "token; chunked prefill "
                + ("as the server runs it" if chunked == "as-is" else
                   "on, then off (switched on the simulator)" if chunked == "both" else
                   f"{chunked} (switched on the simulator)"))
    else:
        what = (f"{p['requests']} Poisson arrivals per point (seed {p['seed']}), "
                f"{p['prompt_tokens']}-token prompts, max_tokens {p['max_tokens']}")
    return (f"workload: /v1/completions, ignore_eos, temperature 0, streamed; {what}; "
            f"{repeats}")


def _ratio(a: Any, b: Any) -> str:
    return "-" if not a or not b else f"x{b / a:.2f}"


def _shape(run: Row, points: Sequence[Row]) -> list[str]:
    kind, summary = run["kind"], run["summary"] or {}
    lines: list[str] = []
    if kind in ("prompt", "concurrency", "rate") and len(points) >= 2:
        first, last = points[0], points[-1]
        itls = [p["itl_p50_s"] for p in points if p["itl_p50_s"]]
        spread = f", max/min across points {max(itls) / min(itls):.3f}" if itls else ""
        lines.append(
            f"{first['x_name']} {first['x_value']:g} -> {last['x_value']:g}: TTFT p50 "
            f"{_ratio(first['ttft_p50_s'], last['ttft_p50_s'])}, ITL p50 "
            f"{_ratio(first['itl_p50_s'], last['itl_p50_s'])}{spread}, output throughput "
            f"{_ratio(first['output_throughput_tps'], last['output_throughput_tps'])}, "
            f"achieved concurrency {num(first['concurrency'], 1)} -> {num(last['concurrency'], 1)}")
    if kind == "interference" and points and len(points) % 3 == 0:
        lines += _interference_lines(run, points)
    if kind == "goodput":
        lines += _goodput_lines(summary, points)
    phasewatch = summary.get("phasewatch")
    if phasewatch:
        lines.append(
            f"phasewatch stored {phasewatch['records']} of the {phasewatch['requests_tagged']} "
            f"requests tagged with this run (GET /api/requests?run_id={run['id']}); its TTFT "
            "runs from when it has the request to when it reads the first token, a little "
            "inside the client's; its ITL p50 is the median of each request's own p50.")
    if summary.get("error"):
        lines.append(f"the run failed: {summary['error']}")
    return lines


def _interference_lines(run: Row, points: Sequence[Row]) -> list[str]:
    """Per chunked-prefill setting: the long prompt's TTFT and the short stream's stall; then
    the two settings side by side, and why they cannot differ when they cannot."""
    summary, p = run["summary"] or {}, run["parameters"]
    variants = {v.get("chunked_prefill"): v for v in summary.get("variants") or []}
    lines: list[str] = []
    if summary.get("long_prompt"):
        lines.append(f"long prompt: {summary['long_prompt']}")
    stalls: dict[str, float] = {}
    for index in range(0, len(points), 3):
        before, during, after = points[index:index + 3]
        chunked = _get(during, "extra", "chunked_prefill")
        variant = variants.get(chunked) or summary
        stall = _get(during, "extra", "itl_max_s")
        if chunked and stall is not None:
            stalls[chunked] = stall
        budget = _get(during, "extra", "max_num_batched_tokens")
        setting = (f"chunked prefill {chunked}" + (f" (max_num_batched_tokens {budget})"
                                                   if budget else "") + ": ") if chunked else ""
        lines.append(
            f"{setting}the long prompt's TTFT (client, p50 over repeats) "
            f"{ms(variant.get('long_ttft_s'))} ms; the short stream's ITL p50 "
            f"{ms(before['itl_p50_s'], 2)} ms before, max {ms(stall, 2)} ms during "
            f"({_ratio(before['itl_p50_s'], stall)} the p50 before), p50 "
            f"{ms(after['itl_p50_s'], 2)} ms after")
        if variant.get("long_errors"):
            lines.append(f"the long prompt FAILED in {variant['long_errors']} repeat(s) (does "
                         "the server's max_model_len hold it?)")
        proxy_long = _get(during, "extra", "proxy", "long_ttft_s", "p50")
        if proxy_long is not None:
            lines.append(f"phasewatch stored the long prompt's TTFT as {ms(proxy_long)} ms"
                         + (f" (chunked prefill {chunked})" if chunked else ""))
    if "on" in stalls and "off" in stalls:
        lines.append(
            f"chunked prefill on against off: the short stream's longest stall "
            f"{ms(stalls['on'])} ms against {ms(stalls['off'])} ms "
            f"(off is {_ratio(stalls['on'], stalls['off'])} on)")
    if summary.get("same_step"):
        lines.append(f"on and off cannot differ here: {summary['same_step']}")
    if p.get("chunked_prefill", "as-is") == "as-is" and (run["engine"] or {}).get("sim"):
        lines.append("the simulator can measure both settings in one run: "
                     "--chunked-prefill both")
    return lines


def _goodput_lines(summary: Row, points: Sequence[Row]) -> list[str]:
    slo = summary.get("slo") or {}
    share = int(str(slo.get("quantile", "p95")).removeprefix("p"))
    objective = (f"{share}% of requests good (TTFT <= {ms(slo.get('ttft_s'), 0)} ms and TPOT "
                 f"<= {ms(slo.get('itl_s'), 1)} ms each)")
    if "judged" not in slo:  # stored by an older bench: the words below would misstate it
        return [f"best rate {summary.get('best_rate')} req/s, next {summary.get('next_rate')} "
                "req/s, judged by an older bench on quantiles of TTFT and of per-chunk ITL, "
                "not per request"]
    by_step = {p["step"]: p for p in points}
    best, nxt = by_step.get(summary.get("best_step")), by_step.get(summary.get("next_step"))
    if best is None and nxt is not None:
        return [f"no rate tried has {objective}: the lowest, {nxt['x_value']:g} req/s, missed "
                f"({'; '.join(_get(nxt, 'extra', 'slo_misses') or [])})"]
    if best is not None and nxt is None:
        return [f"every rate tried up to {best['x_value']:g} req/s has {objective}: raise "
                "--max-rate to find the limit"]
    if best is None or nxt is None:
        return []
    lines = [
        f"highest rate with {objective}: {best['x_value']:g} req/s, goodput there "
        f"{num(best['goodput_rps'], 2)} req/s; the next step, {nxt['x_value']:g} req/s, "
        f"missed: {'; '.join(_get(nxt, 'extra', 'slo_misses') or [])}"]
    more = [p for p in points if _get(p, "extra", "slo_met") is False
            and (p["goodput_rps"] or 0) > (best["goodput_rps"] or 0)]
    if more:
        top = max(more, key=lambda p: p["goodput_rps"])
        lines.append(
            f"{top['x_value']:g} req/s served more good requests per second "
            f"({num(top['goodput_rps'], 2)}), but only "
            f"{_percent(_get(top, 'extra', 'figures', 'slo_attainment'))}% of its requests were "
            f"good: the search asks that {share}% be good, not for the most good requests")
    return lines


def render(run: Row, points: Sequence[Row]) -> str:
    ordered = sorted(points, key=lambda p: p["step"])
    if run["kind"] == "interference":
        columns = _interference_columns(ordered)
    else:
        columns = _point_columns(run, ordered)
    lines = [*_header(run), "", *table(columns, ordered), ""]
    lines += _shape(run, ordered)
    return "\n".join(lines).rstrip() + "\n"
