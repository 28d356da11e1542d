"""Two phasewatch builds side by side, under the same load at the same time: which costs less.

`proxy_overhead.py` runs its paths one after another. On a shared VM whose speed drifts by
tens of percent within minutes, the same build measured twenty seconds apart can read 10%
apart, so a change worth a few percent cannot be judged that way. Here both builds run at
once, behind one upstream (`fast_upstream.py`), each under its own copy of the same open-loop
schedule (`loadgen.py`, same seed, same start time): every drift of the machine lands on both.

- A is the baseline: another checkout (`--baseline-source`, e.g. a git worktree of the commit
  before a change), this checkout as it is (with `--variant`, or `--same`), or nginx
  (`--nginx`, configured as `proxy_overhead.py` configures it: one process, no buffering,
  kept-alive upstream connections), which puts `proxy_overhead.py`'s ratio to nginx to the
  same test: each path's figure is then taken under the same drift of the machine;
- B is this checkout, with the `--variant` settings (against nginx, `--b-variant`'s) if
  given. `--same` runs this checkout as both: an A/A run, the method's own resolution.

Each pair is two runs with the roles swapped (which build starts first and takes the first
port), so an advantage of position cancels. Both proxies start fresh for every run. Reported
per run and as medians over runs: each build's CPU per content chunk (user+sys of its process
over the run, /proc/PID/stat, per chunk its clients received), the ratio B/A, and each build's
TTFT and chunk-lag percentiles as its clients saw them (absolute: both share the upstream, so
the difference B - A is what one build adds over the other).

Run: `.venv/bin/python benchmarks/proxy_ab.py --baseline-source /tmp/pw-base [--pairs 3]`;
`--quick` is a smoke run of well under a minute. Writes only its JSON result (`--json`, by
default under benchmarks/results/, which git ignores) and temp files.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy_overhead import (
    DEFAULT_NGINX,
    HERE,
    Server,
    cpu_window,
    fmt,
    make_shape,
    median,
    nginx_version,
    parse_variants,
    percentile_ms,
    raise_fd_limit,
    run_loadgen,
    source_env,
    start_nginx,
    start_phasewatch,
    start_upstream,
    stop,
)


def one_run(args: argparse.Namespace, upstream: Server, envs: dict[str, dict[str, str]],
            order: Sequence[str], seed: int, tmp: Path) -> dict[str, Any]:
    """Both builds at once, started in `order`; their CPU per chunk and client-side figures."""
    shape = make_shape(args, args.concurrency)
    proxies: dict[str, Server] = {}
    try:
        for build in order:
            if build == "A" and args.nginx is not None:
                proxies[build] = start_nginx(args.nginx, upstream, tmp)
                proxies[build].name = build
                continue
            proxies[build] = start_phasewatch(upstream, tmp, name=build, extra_env=envs[build])
        results: dict[str, dict[str, Any]] = {}
        failures: list[BaseException] = []
        start_at = time.monotonic_ns() + 2_000_000_000  # for both load generators to connect

        def load(build: str) -> None:
            out = tmp / f"load-{build}"
            out.mkdir(exist_ok=True)
            try:
                results[build] = run_loadgen(args, proxies[build], shape, seed, out, start_at)
            except BaseException as exc:  # reported below, on the main thread
                failures.append(exc)

        threads = [threading.Thread(target=load, args=(build,)) for build in order]
        with cpu_window(list(proxies.values())) as cpu:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if failures:
            raise failures[0]
    finally:
        for server in proxies.values():
            stop(server)
    run: dict[str, Any] = {"first": order[0]}
    for build in ("A", "B"):
        result, cpu_s = results[build], cpu[build]
        chunks = result["content_chunks"]
        run[build] = {
            "cpu_us_per_chunk": cpu_s / chunks * 1e6 if cpu_s is not None and chunks else None,
            "ttft_p50_ms": percentile_ms(result["ttft_ns"], 0.50),
            "ttft_p99_ms": percentile_ms(result["ttft_ns"], 0.99),
            "lag_p50_ms": percentile_ms(result["lag_ns"], 0.50),
            "lag_p99_ms": percentile_ms(result["lag_ns"], 0.99),
            "ok": result["ok"], "scheduled": result["scheduled"], "errors": result["errors"],
            "content_chunks": chunks,
        }
    a, b = run["A"]["cpu_us_per_chunk"], run["B"]["cpu_us_per_chunk"]
    run["cpu_ratio"] = b / a if a and b else None
    return run


def print_run(index: int, run: dict[str, Any]) -> None:
    a, b = run["A"], run["B"]
    print(f"  run {index} ({run['first']} first): CPU/chunk A "
          f"{fmt(a['cpu_us_per_chunk'], digits=1)} us, B {fmt(b['cpu_us_per_chunk'], digits=1)} "
          f"us, B/A {fmt(run['cpu_ratio'], digits=3)}; TTFT p99 A {fmt(a['ttft_p99_ms'])} "
          f"B {fmt(b['ttft_p99_ms'])} ms; lag p99 A "
          f"{fmt(a['lag_p99_ms'])} B {fmt(b['lag_p99_ms'])} ms; ok {a['ok']}/{a['scheduled']} "
          f"and {b['ok']}/{b['scheduled']}", flush=True)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"cpu_ratio": median([r["cpu_ratio"] for r in runs])}
    ratios = [r["cpu_ratio"] for r in runs if r["cpu_ratio"] is not None]
    summary["cpu_ratio_range"] = [min(ratios), max(ratios)] if ratios else None
    for key in ("cpu_us_per_chunk", "ttft_p50_ms", "ttft_p99_ms", "lag_p50_ms", "lag_p99_ms"):
        summary[key] = {build: median([r[build][key] for r in runs]) for build in ("A", "B")}
        diffs = [r["B"][key] - r["A"][key] for r in runs
                 if r["A"][key] is not None and r["B"][key] is not None]
        summary[key]["B-A"] = median(diffs)
    summary["errors"] = sum(sum(r[b]["errors"].values()) for r in runs for b in ("A", "B"))
    return summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--baseline-source", type=Path, default=None,
                       help="A: phasewatch from this other checkout (e.g. a git worktree of "
                            "the commit before a change); B: this checkout")
    which.add_argument("--variant", metavar="NAME:KEY=VALUE[,...]", default=None,
                       help="B: this checkout with these settings; A: this checkout as it is")
    which.add_argument("--same", action="store_true",
                       help="this checkout as A and as B: the method's own resolution")
    which.add_argument("--nginx", nargs="?", const=DEFAULT_NGINX,
                       default=None, metavar="BINARY",
                       help="A: nginx (this binary; default the one on PATH), B: this checkout "
                            "(with --b-variant's settings, if given)")
    p.add_argument("--b-variant", metavar="NAME:KEY=VALUE[,...]", default=None,
                   help="with --nginx: B runs with these settings")
    p.add_argument("--concurrency", type=int, default=128,
                   help="concurrent streams held through each build (default 128: with both, "
                        "proxy_overhead's 256)")
    p.add_argument("--chunk-rate", type=float, default=1600.0,
                   help="chunks per second through each build (default 1600; 0 uses "
                        "--interval-ms)")
    p.add_argument("--chunks", type=int, default=64, help="content chunks per stream")
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--first-delay-ms", type=float, default=0.0)
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals per run (default: 10, or twice a stream's life)")
    p.add_argument("--warmup", type=float, default=None,
                   help="arrivals in the first seconds are not measured (default: a stream's "
                        "life, at least 2 s)")
    p.add_argument("--pairs", type=int, default=3,
                   help="pairs of runs, roles swapped within each (default 3: six runs)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--client-usage", choices=["none", "final", "continuous"], default="none",
                   help="stream_options the clients send (none: usage added and stripped)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=None,
                   help="where to write results (default benchmarks/results/...json)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 16 streams each, 8 chunks, one pair of 3 s runs")
    args = p.parse_args(argv)
    if args.b_variant is not None and args.nginx is None:
        p.error("--b-variant goes with --nginx (else use --variant)")
    args.loadgen_procs = 1  # run_loadgen's shards: one per build
    if args.quick:
        args.concurrency, args.chunks, args.pairs = 16, 8, 1
        args.duration, args.warmup, args.chunk_rate = 3.0, 1.0, 0.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    shape = make_shape(args, args.concurrency)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    if args.nginx is not None:
        with_settings = f" with {args.b_variant}" if args.b_variant else ""
        described = (f"this checkout{with_settings} (B) against nginx "
                     f"{nginx_version(args.nginx)} (A)")
    elif args.baseline_source is not None:
        described = f"this checkout (B) against {args.baseline_source} (A)"
    elif args.variant is not None:
        described = f"this checkout with {args.variant} (B) against it as it is (A)"
    else:
        described = "this checkout as both A and B (an A/A run: the method's resolution)"
    print(f"A/B, side by side: {described}")
    print(f"  each: {shape.concurrency} streams of {args.chunks} content chunks, one every "
          f"{shape.interval_ms:g} ms ({shape.concurrency * 1000 / shape.interval_ms:,.0f} "
          f"chunks/s); arrivals for {shape.duration:g} s, the first {shape.warmup:g} s not "
          f"measured; {args.pairs} pair(s) of runs, roles swapped", flush=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="phasewatch-ab-") as tmpname:
        tmp = Path(tmpname)
        upstream = start_upstream(args, tmp)
        try:
            for pair in range(args.pairs):
                for order in (("A", "B"), ("B", "A")):
                    run_tmp = tmp / f"run-{len(runs)}"
                    run_tmp.mkdir()
                    envs: dict[str, dict[str, str]] = {"A": {}, "B": {}}
                    if args.baseline_source is not None:
                        envs["A"] = source_env(args.baseline_source, run_tmp)
                    elif args.variant is not None or args.b_variant is not None:
                        envs["B"] = parse_variants([args.variant or args.b_variant])[0][1]
                    run = one_run(args, upstream, envs, order, args.seed * 1000 + pair, run_tmp)
                    runs.append(run)
                    print_run(len(runs), run)
        finally:
            stop(upstream)
    summary = summarize(runs)
    cpu, ttft, lag = summary["cpu_us_per_chunk"], summary["ttft_p99_ms"], summary["lag_p99_ms"]
    low_high = summary["cpu_ratio_range"]
    print(f"CPU per chunk, medians over {len(runs)} runs: A {fmt(cpu['A'], digits=1)} us, B "
          f"{fmt(cpu['B'], digits=1)} us; B/A {fmt(summary['cpu_ratio'], digits=3)} (runs "
          f"{fmt(low_high[0] if low_high else None, digits=3)}-"
          f"{fmt(low_high[1] if low_high else None, digits=3)})")
    print(f"TTFT p99 A {fmt(ttft['A'])} ms, B {fmt(ttft['B'])} ms (B - A {fmt(ttft['B-A'])}); "
          f"chunk lag p99 A {fmt(lag['A'])} ms, B {fmt(lag['B'])} ms (B - A {fmt(lag['B-A'])})")
    if summary["errors"]:
        print(f"streams with errors: {summary['errors']} (see the JSON)")
    out = args.json or HERE / "results" / f"proxy_ab-{started}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "started": started, "compared": described, "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": runs, "summary": summary,
    }, indent=2))
    print(f"results written to {out}")
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
