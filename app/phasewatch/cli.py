"""The `phasewatch` command: a thin shell over the library (tests call the library directly)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from phasewatch import __version__
from phasewatch.bench.cli import add_parser as add_bench_parser
from phasewatch.core.settings import SettingsError, load_settings
from phasewatch.plan.cli import add_parser as add_plan_parser
from phasewatch.sim.cli import add_parser as add_sim_parser
from phasewatch.slo.cli import add_parser as add_slo_parser

if TYPE_CHECKING:
    from phasewatch.demo import StackOptions

# The demo's simulator runs this many times slower than real time: at 64 streams, three
# processes on two cores would otherwise add Python's per-chunk costs to the model's ITL.
DEMO_TIME_SCALE = 2.0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from phasewatch.core.db import MissingDriver, require_driver
    from phasewatch.core.event_loop import loop_name
    from phasewatch.otel import OtelConfigError, check_otel
    from phasewatch.proxy.client_leg import PhasewatchHttpProtocol
    from phasewatch.serve import prepare_serving
    from phasewatch.store.migrate import SchemaError

    overrides = {
        key: value
        for key, value in {
            "upstream_url": args.upstream, "host": args.host, "port": args.port,
            "workers": args.workers,
        }.items()
        if value is not None
    }
    try:
        settings = load_settings(**overrides)
    except SettingsError as exc:
        print(f"phasewatch: invalid configuration: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        # The workers' environment, the open-file limit, the schema once.
        require_driver(settings.database_url)  # said here, not in every worker
        if settings.otel_enabled:
            check_otel(os.environ)
        connections = prepare_serving(settings, overrides)
    except (SchemaError, MissingDriver, OtelConfigError) as exc:
        print(f"phasewatch: {exc}", file=sys.stderr)
        return 2
    loop = loop_name()
    logging.getLogger("phasewatch").info(
        "serving on %s:%d: %s event loop%s, httptools HTTP parser", settings.host, settings.port,
        loop, "" if loop == "uvloop" else " (uvloop is not installed)")
    uvicorn.run(
        # Each worker builds its own app from the environment; with --workers N, uvicorn's
        # supervisor runs N processes on the one socket (and restarts any that dies).
        "phasewatch.main:serve_app", factory=True, workers=settings.workers,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        loop=loop,
        # uvicorn's httptools protocol, plus the relay's arrival stamp and direct body writes.
        http=PhasewatchHttpProtocol,
        # The upstream's own Date and Server headers are relayed; do not add a second pair.
        server_header=False,
        date_header=False,
        backlog=4096,
        proxy_headers=False,  # a relay has no use for X-Forwarded-For: skip that per-request work
        timeout_keep_alive=75,
        # phasewatch ends its own streams when its grace is over (app/phasewatch/proxy/shutdown.py);
        # uvicorn's own cut-off, which would end them without a word, comes only after.
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s) + 10,
        # A connection past `connections` is answered 503 at once (PhasewatchHttpProtocol
        # refuses the one that reaches this), so descriptors never run out mid-stream.
        limit_concurrency=connections + 1,
    )
    return 0


def _db(args: argparse.Namespace) -> int:
    import asyncio

    from phasewatch.core.db import MissingDriver, create_engine
    from phasewatch.store.migrate import schema_state, upgrade

    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"phasewatch: invalid configuration: {exc}", file=sys.stderr)
        return 2
    url = settings.database_url
    try:
        engine = create_engine(url)
    except MissingDriver as exc:
        print(f"phasewatch: {exc}", file=sys.stderr)
        return 2
    if args.action == "upgrade":
        upgrade(url, args.revision)

    async def state() -> str:
        try:
            found = await schema_state(engine)
        finally:
            await engine.dispose()
        status = "up to date" if found.current == found.head else "behind"
        return f"revision {found.current or 'none'} (code needs {found.head}): {status}"

    print(f"database {url.split('@')[-1]}: {asyncio.run(state())}")
    return 0


def _stack_options(args: argparse.Namespace) -> StackOptions:
    from phasewatch.demo import StackOptions

    return StackOptions(
        gpu=args.gpu, model=args.model, time_scale=args.time_scale,
        sim_port=args.sim_port, proxy_port=args.proxy_port,
    )


def _demo(args: argparse.Namespace) -> int:
    from phasewatch.bench.article import DemoOptions
    from phasewatch.demo import run_demo

    options = DemoOptions()
    if args.quick:
        options = DemoOptions(prompt_sweep=(64, 1024), concurrency_sweep=(1, 8), max_tokens=32)
    return run_demo(_stack_options(args), options)


def _up(args: argparse.Namespace) -> int:
    from phasewatch.demo import run_up

    return run_up(_stack_options(args))


def _add_stack_parsers(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    demo = commands.add_parser(
        "demo", help="start the simulator and the proxy, run the article's two experiments "
        "through the proxy, print the tables, stop",
    )
    up = commands.add_parser(
        "up", help="serve the simulator and the proxy in front of it until Ctrl-C"
    )
    demo.add_argument("--quick", action="store_true",
                      help="two points per experiment and 32-token outputs: a smoke run of a "
                      "few seconds (default: the full sweeps)")
    stacks = ((demo, DEMO_TIME_SCALE, 0, 0), (up, 1.0, 8000, 8080))
    for parser, scale, sim_port, proxy_port in stacks:
        parser.add_argument("--gpu", default="t4", help="simulator GPU preset (default t4)")
        parser.add_argument("--model", default="qwen2.5-0.5b",
                            help="simulator model preset (default qwen2.5-0.5b)")
        parser.add_argument("--time-scale", type=float, default=scale,
                            help=f"simulator's wall seconds per model second (default {scale:g})")
        parser.add_argument("--sim-port", type=int, default=sim_port,
                            help=f"simulator port (default {sim_port or 'a free one'})")
        parser.add_argument("--proxy-port", type=int, default=proxy_port,
                            help=f"proxy port (default {proxy_port or 'a free one'})")
    demo.set_defaults(func=_demo)
    up.set_defaults(func=_up)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phasewatch",
        description="An OpenAI-compatible proxy that times prefill (TTFT) and decode (ITL).",
    )
    parser.add_argument("--version", action="version", version=f"phasewatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="run the proxy (settings from PHASEWATCH_* environment variables)"
    )
    serve.add_argument("--upstream", help="upstream base URL (PHASEWATCH_UPSTREAM_URL)")
    serve.add_argument("--host", help="listen address (PHASEWATCH_HOST)")
    serve.add_argument("--port", type=int, help="listen port (PHASEWATCH_PORT)")
    serve.add_argument("--workers", type=int,
                       help="processes serving that port (PHASEWATCH_WORKERS, default 1)")
    serve.set_defaults(func=_serve)
    db = commands.add_parser("db", help="database schema (PHASEWATCH_DATABASE_URL)")
    db_actions = db.add_subparsers(dest="action", required=True)
    upgrade = db_actions.add_parser("upgrade", help="apply migrations")
    upgrade.add_argument("revision", nargs="?", default="head")
    db_actions.add_parser("current", help="show the schema revision")
    db.set_defaults(func=_db)
    add_sim_parser(commands)
    add_bench_parser(commands)
    add_slo_parser(commands)
    add_plan_parser(commands)
    _add_stack_parsers(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
