"""`phasewatch plan`: calibrate on stored traffic, then answer a what-if.

Reads a model's requests of the last `--window` (or of `--from-run`) from the database,
calibrates the step model (fit.py, refine.py) and replays the asked load through the
simulator's scheduler (whatif.py): predicted TTFT and ITL, the share of each within its SLO
threshold, and the fewest replicas that meet both objectives. `--json` prints one object.

Exit codes: 0 answered; 2 the question or the data cannot be answered (the reason on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

from phasewatch.plan.fit import Calibration, CannotCalibrate, calibrate
from phasewatch.plan.traffic import Request
from phasewatch.plan.whatif import Lengths, Limits, Workload, predict, replicas_needed

# What the model cannot see, said with every answer.
BLIND_SPOTS = (
    "the KV cache is not modelled: preemption under memory pressure is not predicted",
    "prefix caching is not modelled: prompts are prefilled whole",
    "the calibration holds for the GPU, model and engine flags it was measured on",
)
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default; said as assumed when used


def _duration(text: str) -> timedelta:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 90s, 30m, 1h or 2d")
    unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    return timedelta(seconds=float(match.group(1)) * unit)


def _tokens(text: str) -> int | None:
    if text == "observed":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a token count, or 'observed'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `plan` on a parent parser's subcommands; `args.func(args)` runs it."""
    parser = subparsers.add_parser(
        "plan", help="capacity from stored traffic: predicted TTFT/ITL for a load, replicas "
        "needed (PHASEWATCH_DATABASE_URL)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--window", type=_duration, default=timedelta(hours=1),
                        help="calibrate on this last span of stored requests (default 1h)")
    source.add_argument("--from-run", help="calibrate on the requests of a stored run")
    parser.add_argument("--model", help="the model (default: the one with the most requests)")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="requests per second, Poisson arrivals")
    load.add_argument("--concurrency", type=int, help="users, each sending its next request "
                      "when its last ends")
    parser.add_argument("--prompt-tokens", type=_tokens, default=None, metavar="N|observed",
                        help="prompt length (default: as observed)")
    parser.add_argument("--output-tokens", type=_tokens, default=None, metavar="N|observed",
                        help="output length (default: as observed)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help=f"the engine's cap on running sequences (default "
                        f"{DEFAULT_MAX_NUM_SEQS}, vLLM's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="the engine's token budget per step (default 8192)")
    parser.add_argument("--replicas", type=int, default=1, help="replicas sharing the load")
    parser.add_argument("--objective", type=float, default=0.95,
                        help="share within each SLO threshold that meets it (default 0.95)")
    parser.add_argument("--requests", type=int, default=2000,
                        help="requests simulated per prediction (default 2000)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--database-url", help="default: PHASEWATCH_DATABASE_URL")
    parser.set_defaults(func=run)


async def _read(args: argparse.Namespace, database_url: str) -> tuple[str, list[Request]]:
    from sqlalchemy import func, select

    from phasewatch.core.db import create_engine, create_sessionmaker
    from phasewatch.store.models import RequestRow
    from phasewatch.store.plan_inputs import timed_requests

    engine = create_engine(database_url)
    try:
        async with create_sessionmaker(engine)() as session:
            since = None if args.from_run else datetime.now(UTC) - args.window
            model = args.model
            if model is None:
                query = select(RequestRow.model, func.count()).group_by(RequestRow.model)
                if since is not None:
                    query = query.where(RequestRow.started_at >= since)
                if args.from_run:
                    query = query.where(RequestRow.run_id == args.from_run)
                counts = (await session.execute(query)).all()
                model = max(counts, key=lambda row: row[1])[0] if counts else None
            rows = await timed_requests(session, model=model, since=since,
                                        run_id=args.from_run)
    finally:
        await engine.dispose()
    return model or "", [Request(*row) for row in rows]


def answer(args: argparse.Namespace, model: str, requests: list[Request], slo_ttft_s: float,
           slo_itl_s: float) -> dict[str, Any]:
    """The JSON answer (pure: no I/O)."""
    from phasewatch.plan.refine import refine

    assumed: list[str] = []
    max_num_seqs = args.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = DEFAULT_MAX_NUM_SEQS
        assumed.append(f"max_num_seqs {DEFAULT_MAX_NUM_SEQS} (vLLM's default; pass "
                       "--max-num-seqs)")
    limits = Limits(max_num_seqs, args.max_num_batched_tokens)
    calibration: Calibration = refine(calibrate(requests, args.max_num_seqs), limits, requests)
    lengths = Lengths(
        [args.prompt_tokens] if args.prompt_tokens else [r.prompt_tokens for r in requests],
        [args.output_tokens] if args.output_tokens else [r.output_tokens for r in requests])
    workload = Workload(lengths, rate_rps=args.rate, concurrency=args.concurrency,
                        requests=args.requests)
    prediction = predict(calibration, limits, workload.share(args.replicas),
                         slo_ttft_s=slo_ttft_s, slo_itl_s=slo_itl_s)
    needed = replicas_needed(calibration, limits, workload, objective=args.objective,
                             slo_ttft_s=slo_ttft_s, slo_itl_s=slo_itl_s)
    return {
        "model": model,
        "calibration": calibration.as_dict(),
        "workload": {"rate_rps": args.rate, "concurrency": args.concurrency,
                     "prompt_tokens": args.prompt_tokens or "observed",
                     "output_tokens": args.output_tokens or "observed",
                     "replicas": args.replicas},
        "limits": {"max_num_seqs": limits.max_num_seqs,
                   "max_num_batched_tokens": limits.max_num_batched_tokens,
                   "assumed": assumed},
        "predicted": {"ttft_p50_s": prediction.ttft_p50_s, "ttft_p95_s": prediction.ttft_p95_s,
                      "itl_p50_s": prediction.itl_p50_s, "itl_p95_s": prediction.itl_p95_s,
                      "decode_batch_mean": prediction.batch_mean},
        "slo": {"ttft_threshold_s": slo_ttft_s, "itl_threshold_s": slo_itl_s,
                "objective": args.objective, "ttft_share": prediction.ttft_share,
                "itl_share": prediction.itl_share, "met": prediction.meets(args.objective)},
        "replicas_needed": needed,
        "extrapolated": prediction.extrapolated,
        "unidentified": prediction.unidentified,
        "cannot_see": list(BLIND_SPOTS),
    }


def _text(result: dict[str, Any]) -> str:
    p, s, c = result["predicted"], result["slo"], result["calibration"]
    load = (f"{result['workload']['rate_rps']:g} requests/s"
            if result["workload"]["rate_rps"] is not None
            else f"{result['workload']['concurrency']} users")
    lines = [
        f"phasewatch plan: {result['model']}, {load} on {result['workload']['replicas']} "
        f"replica(s), calibrated on {c['observed']['requests']} requests",
        f"  TTFT p50 {p['ttft_p50_s'] * 1e3:.0f} ms, p95 {p['ttft_p95_s'] * 1e3:.0f} ms; "
        f"{s['ttft_share']:.1%} within {s['ttft_threshold_s'] * 1e3:.0f} ms",
        f"  ITL  p50 {p['itl_p50_s'] * 1e3:.1f} ms, p95 {p['itl_p95_s'] * 1e3:.1f} ms; "
        f"{s['itl_share']:.1%} of gaps within {s['itl_threshold_s'] * 1e3:.0f} ms",
        f"  both SLOs at {s['objective']:.0%}: {'met' if s['met'] else 'MISSED'}; "
        "replicas needed: " + (str(result["replicas_needed"]) if result["replicas_needed"]
                               else "none suffices (a request alone misses an objective)"),
    ]
    for kind in ("extrapolated", "unidentified"):
        lines += [f"  {kind}: {note}" for note in result[kind]]
    lines += [f"  assumed: {note}" for note in result["limits"]["assumed"]]
    lines += [f"  refused: {term}: {why}" for term, why in c["refused"].items()]
    lines.append(f"  fit: ITL error p50 {c['fit']['itl_error_p50']:.1%}, unqueued TTFT error "
                 f"p50 {c['fit']['ttft_error_p50']:.1%}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from phasewatch.core.settings import SettingsError, load_settings

    try:
        settings = load_settings(**({"database_url": args.database_url}
                                    if args.database_url else {}))
    except SettingsError as exc:
        print(f"phasewatch plan: {exc}", file=sys.stderr)
        return 2
    if (args.rate is not None and args.rate <= 0) or (
            args.concurrency is not None and args.concurrency < 1) or args.replicas < 1:
        print("phasewatch plan: --rate must be above 0, --concurrency and --replicas at least 1",
              file=sys.stderr)
        return 2
    model, requests = asyncio.run(_read(args, settings.database_url))
    try:
        result = answer(args, model, requests, settings.slo_ttft_s, settings.slo_itl_s)
    except CannotCalibrate as exc:
        where = f"run {args.from_run}" if args.from_run else f"the last {args.window}"
        print(f"phasewatch plan: {model or 'no model'} in {where}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else _text(result))
    return 0
