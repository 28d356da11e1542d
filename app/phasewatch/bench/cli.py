"""`phasewatch bench ...` and `phasewatch runs ...`: the argparse shell over `phasewatch.bench`.

`bench MODE` measures one experiment against any OpenAI-compatible base URL (vLLM, phasewatch,
the simulator), prints the report, writes `<run id>.json` and `<run id>.png` under `--out`, and
stores the run in the database of `--database-url` (default: `PHASEWATCH_DATABASE_URL`, the
proxy's own). `runs list|show|compare` read stored runs back and never create a database.
Every option's help states its default. Heavy imports wait until a command runs. Exit codes:
0 done, 1 the target could not be measured, or a run or the database was not found, 2 bad
configuration, 130 interrupted (the run is stored as failed, with its points so far).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from phasewatch.bench.modes import ModeOptions
    from phasewatch.bench.stats import Slo

T = TypeVar("T")
DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_DB = "sqlite+aiosqlite:///phasewatch.db"  # the proxy's default (core.settings)


def _ints(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"OpenAI-compatible base URL, without /v1 (default {DEFAULT_URL})")
    parser.add_argument("--model", help="model to ask for (default: the first /v1/models lists)")
    parser.add_argument("--name", help="a name for the run, shown by `runs list` (default: "
                        "kind and model)")
    parser.add_argument("--repeats", type=_ints, default=1,
                        help="run the whole sweep this many times, interleaved (default 1); "
                        "2 or more measure the noise `runs compare` needs")
    parser.add_argument("--database-url", help="where runs are stored (default "
                        f"PHASEWATCH_DATABASE_URL, the proxy's; unset: {DEFAULT_DB})")
    parser.add_argument("--no-store", action="store_true",
                        help="do not store the run (default: stored)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for <run id>.json and .png (default ./bench-results)")
    parser.add_argument("--no-plots", action="store_true",
                        help="write no PNG (default: one PNG per run, with the bench extra)")
    parser.add_argument("--tokenizer", help="a local tokenizer.json (or a folder with one), for "
                        "servers without /tokenize (default: none; the server's /tokenize, "
                        "else the model's cached tokenizer, else an estimate)")
    parser.add_argument("--engine-url", help="the engine's base URL for its /metrics, "
                        "/server_info and the simulator's switch, when the target is a proxy "
                        "(default: the upstream phasewatch names)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (default: progress shown)")


def _x_scale(parser: argparse.ArgumentParser, default: str, why: str) -> None:
    parser.add_argument("--x-scale", choices=["linear", "log"],
                        help=f"the plot's x axis (default {default}: {why})")


def _slo_flags(parser: argparse.ArgumentParser, search: bool) -> None:
    default = (" (default PHASEWATCH_SLO_{}_S, the proxy's)" if search
               else " (default: none, and no goodput columns)")
    parser.add_argument("--slo-ttft-ms", type=_positive,
                        help="TTFT objective for each request, ms" + default.format("TTFT"))
    parser.add_argument("--slo-itl-ms", type=_positive,
                        help="ITL objective for each request's TPOT (its mean gap between "
                        "tokens, as vllm bench serve --goodput tpot:MS), ms"
                        + default.format("ITL"))
    parser.add_argument("--slo-quantile", choices=["p50", "p90", "p95", "p99"], default="p95",
                        help="the share of requests that must meet both objectives for a rate "
                        "to pass: p95 means 95%% (default p95)")
    parser.add_argument("--slo-max-error-rate", type=float, default=0.0,
                        help="fraction of requests allowed to fail (default 0)")


def _rate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=_ints, default=100,
                        help="Poisson arrivals per point and repeat (default 100)")
    parser.add_argument("--prompt-tokens", type=_ints, default=256, help="default 256")
    parser.add_argument("--max-tokens", type=_ints, default=128, help="default 128")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the arrival schedule (default 0)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `bench` and `runs` on a parent parser's subcommands."""
    bench = subparsers.add_parser(
        "bench", help="measure TTFT, ITL and throughput: prompt, concurrency, interference, "
        "rate and goodput experiments, stored as runs",
        description="Measure an OpenAI-compatible server from the client's side. Through "
        "phasewatch, requests are tagged with the run id and the proxy's own records are shown "
        "beside the client's figures. Times are model time against the simulator.")
    modes = bench.add_subparsers(dest="mode", required=True)
    prompt = modes.add_parser("prompt", help="longer prompts at a fixed output length")
    prompt.add_argument("--prompt-tokens", type=_ints, nargs="+", default=[64, 256, 1024, 4096],
                        help="prompt lengths swept (default 64 256 1024 4096)")
    prompt.add_argument("--max-tokens", type=_ints, default=128, help="default 128")
    prompt.add_argument("--requests", type=_ints, default=3,
                        help="requests per point and repeat (default 3)")
    prompt.add_argument("--concurrency", type=_ints, default=1,
                        help="requests at a time (default 1, as the article)")
    _x_scale(prompt, "linear", "TTFT is linear in the prompt's length, a straight line there")
    concurrency = modes.add_parser("concurrency", help="more streams at once, fixed prompt")
    concurrency.add_argument("--concurrency", type=_ints, nargs="+", default=[1, 4, 16, 64],
                             help="streams sent together, swept (default 1 4 16 64)")
    concurrency.add_argument("--prompt-tokens", type=_ints, default=256, help="default 256")
    concurrency.add_argument("--max-tokens", type=_ints, default=128, help="default 128")
    concurrency.add_argument("--requests-per-stream", type=_ints, default=1,
                             help="requests each stream sends back to back (default 1)")
    _x_scale(concurrency, "log", "1 to 64 streams, evenly spaced")
    interference = modes.add_parser(
        "interference", help="a short stream's ITL before, during and after a long prefill")
    interference.add_argument("--short-prompt-tokens", type=_ints, default=64, help="default 64")
    interference.add_argument("--short-max-tokens", type=_ints, default=256,
                              help="per short request (default 256): one request should span "
                              "--before-s, the long prefill and --after-s")
    interference.add_argument("--long-prompt-tokens", type=_ints,
                              help="default: 4 x the server's max_num_batched_tokens when it "
                              "says (the simulator, vLLM's /server_info), so chunked prefill "
                              "has 4 chunks to cut, else 16384; capped by max_model_len")
    interference.add_argument("--long-max-tokens", type=_ints, default=4, help="default 4")
    interference.add_argument("--before-s", type=_positive, default=0.5,
                              help="seconds the short client streams alone, from its first "
                              "token, before the long prompt is sent (default 0.5)")
    interference.add_argument("--after-s", type=_positive, default=0.5,
                              help="seconds it goes on after the long prompt's first token "
                              "(default 0.5)")
    interference.add_argument("--chunked-prefill", choices=["as-is", "on", "off", "both"],
                              default="as-is",
                              help="the simulator's chunked prefill for the run: on, off, or "
                              "both in turn (one run compares them; the setting is put back "
                              "after). Only phasewatch's simulator can switch (default as-is: "
                              "the server's own setting)")
    rate = modes.add_parser("rate", help="open-loop Poisson arrivals at each rate")
    rate.add_argument("--rates", type=_positive, nargs="+", default=[1.0, 2.0, 4.0, 8.0],
                      help="arrival rates swept, requests/s (default 1 2 4 8)")
    _rate_flags(rate)
    _slo_flags(rate, search=False)
    _x_scale(rate, "linear", "rates as asked")
    goodput = modes.add_parser(
        "goodput", help="the highest Poisson rate at which enough requests meet a TTFT and "
        "ITL (TPOT) objective each")
    _slo_flags(goodput, search=True)
    goodput.add_argument("--start-rate", type=_positive, default=1.0,
                         help="first rate tried, requests/s (default 1); doubled while it passes")
    goodput.add_argument("--max-rate", type=_positive, default=256.0,
                         help="highest rate tried (default 256)")
    goodput.add_argument("--bisect-steps", type=int, default=4,
                         help="bisections between the last pass and the first miss (default 4)")
    goodput.add_argument("--tolerance", type=float, default=0.05,
                         help="stop once (miss - pass) / pass is this small (default 0.05)")
    _rate_flags(goodput)
    _x_scale(goodput, "linear", "rates as tried")
    for parser in (prompt, concurrency, interference, rate, goodput):
        _common(parser)
        parser.set_defaults(func=run_bench_from_args)

    runs = subparsers.add_parser("runs", help="stored bench runs: list, show, compare")
    actions = runs.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="the most recent runs, newest first")
    listing.add_argument("--limit", type=_ints, default=20,
                         help="how many runs (default 20)")
    listing.add_argument("--kind", help="only runs of this kind: prompt, concurrency, "
                         "interference, rate, goodput, ... (default: every kind)")
    show = actions.add_parser("show", help="one run's report, as the bench printed it")
    show.add_argument("id", help="a run id, or a unique start of one")
    show.add_argument("--json", action="store_true",
                      help="print the JSON export instead (default: the report)")
    show.add_argument("--plots", type=Path, metavar="DIR",
                      help="also draw its plot into DIR (default: no plot)")
    show.add_argument("--x-scale", choices=["linear", "log"],
                      help="the plot's x axis (default: linear for prompt lengths and rates, "
                      "log for concurrency)")
    compare = actions.add_parser("compare", help="what moved between two runs, beyond noise")
    compare.add_argument("a", help="run A: an id, or a unique start of one")
    compare.add_argument("b", help="run B, compared with A")
    for parser in (listing, show, compare):
        parser.add_argument("--database-url", help="the database to read, never created "
                            f"(default PHASEWATCH_DATABASE_URL; unset: {DEFAULT_DB})")
        parser.set_defaults(func=run_runs_from_args)


def _slo(args: argparse.Namespace) -> Slo | None:
    from phasewatch.bench.stats import Slo
    from phasewatch.core.settings import load_settings

    if args.mode == "goodput":  # the proxy's own SLO pair unless told otherwise
        settings = load_settings()
        args.slo_ttft_ms = args.slo_ttft_ms or settings.slo_ttft_s * 1e3
        args.slo_itl_ms = args.slo_itl_ms or settings.slo_itl_s * 1e3
    if args.slo_ttft_ms is None and args.slo_itl_ms is None:
        return None
    if args.slo_ttft_ms is None or args.slo_itl_ms is None:
        raise ValueError("--slo-ttft-ms and --slo-itl-ms go together")
    return Slo(args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3, args.slo_quantile,
               args.slo_max_error_rate)


def mode_options(args: argparse.Namespace) -> ModeOptions:
    from phasewatch.bench import modes

    if args.mode == "prompt":
        return modes.PromptSweep(tuple(args.prompt_tokens), args.max_tokens, args.requests,
                                 args.concurrency, args.repeats)
    if args.mode == "concurrency":
        return modes.ConcurrencySweep(tuple(args.concurrency), args.prompt_tokens,
                                      args.max_tokens, args.requests_per_stream, args.repeats)
    if args.mode == "interference":
        return modes.Interference(args.short_prompt_tokens, args.short_max_tokens,
                                  args.long_prompt_tokens, args.long_max_tokens, args.before_s,
                                  args.after_s, args.chunked_prefill, args.repeats)
    slo = _slo(args)
    if args.mode == "rate":
        return modes.RateSweep(tuple(args.rates), args.requests, args.prompt_tokens,
                               args.max_tokens, slo, args.seed, args.repeats)
    assert slo is not None
    return modes.GoodputSearch(slo, args.start_rate, args.max_rate, args.bisect_steps,
                               args.tolerance, args.requests, args.prompt_tokens,
                               args.max_tokens, args.seed, args.repeats)


def _database(args: argparse.Namespace) -> tuple[str, bool]:
    from phasewatch.core.settings import load_settings

    settings = load_settings()
    return args.database_url or settings.database_url, settings.database_auto_upgrade


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_bench_from_args(args: argparse.Namespace) -> int:
    from phasewatch.bench.errors import WorkloadError
    from phasewatch.bench.export import export_run
    from phasewatch.bench.progress import make_progress
    from phasewatch.bench.render import render
    from phasewatch.bench.runner import BenchOptions, run_bench
    from phasewatch.bench.storage import RunStore, where
    from phasewatch.core.settings import SettingsError
    from phasewatch.store.migrate import SchemaError

    try:
        options = BenchOptions(args.url, mode_options(args), args.model, args.name,
                               args.tokenizer, args.engine_url)
        database = None if args.no_store else _database(args)
    except (ValueError, SettingsError) as exc:
        print(f"phasewatch bench: {exc}", file=sys.stderr)
        return 2
    progress = make_progress(not args.quiet)
    # What the imports left is long-lived: out of the collector's sight, gen-2 collections
    # during the run stay short (they pause the client's event loop, and so its clock reads).
    gc.collect()
    gc.freeze()

    async def measure() -> Any:
        if database is None:
            return await run_bench(options, None, progress)
        async with RunStore(*database) as store:
            return await run_bench(options, store, progress)

    try:
        result = _run(measure())
    except (WorkloadError, SchemaError) as exc:
        print(f"phasewatch bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("phasewatch bench: interrupted", file=sys.stderr)
        return 130
    written = export_run(result, args.out, plots=not args.no_plots,
                         x_scale=getattr(args, "x_scale", None))
    print(render(result.run, result.points), end="", flush=True)
    print("", *written.lines(), sep="\n")
    if database is not None:
        print(f"stored in {where(database[0])}: phasewatch runs show {result.run['id']}")
    return 0


def run_runs_from_args(args: argparse.Namespace) -> int:
    from phasewatch.bench.compare import render_compare
    from phasewatch.bench.export import export_run
    from phasewatch.bench.render import render
    from phasewatch.bench.result import RunResult, to_json
    from phasewatch.bench.storage import NoDatabase, RunNotFound, RunStore, where
    from phasewatch.core.db import MissingDriver
    from phasewatch.core.settings import SettingsError
    from phasewatch.store.migrate import SchemaError

    try:
        database = _database(args)
    except SettingsError as exc:
        print(f"phasewatch runs: {exc}", file=sys.stderr)
        return 2

    async def read() -> tuple[list[RunResult], list[dict[str, Any]]]:
        async with RunStore(*database, read_only=True) as store:
            if args.action == "list":
                return [], await store.recent(args.limit, args.kind)
            ids = [args.id] if args.action == "show" else [args.a, args.b]
            return [await store.load(i) for i in ids], []

    try:
        loaded, recent = _run(read())
    except NoDatabase as exc:
        print(f"phasewatch runs: {exc}. {_which_database(args)}", file=sys.stderr)
        return 1
    except (RunNotFound, SchemaError, MissingDriver) as exc:
        print(f"phasewatch runs: {exc}", file=sys.stderr)
        return 1
    if args.action == "list":
        print(render_list(recent, where(database[0])), end="")
    elif args.action == "show":
        one = loaded[0]
        if args.json:
            sys.stdout.write(to_json(one).decode() + "\n")
        else:
            print(render(one.run, one.points), end="")
        if args.plots is not None:
            print(*export_run(one, args.plots, x_scale=args.x_scale).lines(), sep="\n")
    else:
        a, b = loaded
        print(render_compare(a.run, a.points, b.run, b.points), end="")
    return 0


def _which_database(args: argparse.Namespace) -> str:
    """Where the URL came from, and how to read the database the bench wrote instead."""
    if args.database_url:
        source = "It is the one --database-url names."
    elif os.environ.get("PHASEWATCH_DATABASE_URL"):
        source = "It is the one PHASEWATCH_DATABASE_URL names."
    else:
        source = ("It is the default: PHASEWATCH_DATABASE_URL is unset, so phasewatch.db in the "
                  "working directory.")
    return (f"{source} The bench prints where it stored each run (\"stored in PATH\"): run "
            "this where the bench ran, or pass --database-url sqlite+aiosqlite:///PATH")


def render_list(runs: list[dict[str, Any]], where: str) -> str:
    from phasewatch.bench.render import Column, table

    if not runs:
        return f"no runs stored in {where}\n"
    columns = [
        Column("run", "id", lambda r: r["id"], left=True),
        Column("run", "name", lambda r: r["name"], left=True),
        Column("run", "kind", lambda r: r["kind"], left=True),
        Column("run", "status", lambda r: r["status"], left=True),
        Column("run", "started (UTC)", lambda r: r["started_at"].strftime("%Y-%m-%d %H:%M:%S")),
        Column("run", "model", lambda r: str(r["parameters"].get("model", "-")), left=True),
        Column("run", "target", lambda r: r["target"], left=True),
    ]
    lines = table(columns, runs)[1:]  # one group: no group line
    return (f"runs in {where}, newest first\n"
            + "\n".join(line.rstrip() for line in lines) + "\n")
