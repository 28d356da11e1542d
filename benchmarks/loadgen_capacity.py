"""Load generator capacity: can `phasewatch bench`'s client hold 512 streams and stay honest?

The client measured is the bench's own code path, in one process on uvloop as `phasewatch bench`
runs it: `phasewatch.bench.load.open_loop` sending `phasewatch.bench.client.stream_request`s
(aiohttp, SSE decoding, per-event classification, one clock read per read). The server is
`fast_upstream.py` (a raw asyncio protocol on uvloop, one process), which writes one chunk per
stream every `--interval-ms` and stamps each chunk's `id` with the `time.monotonic_ns()` read just
before its write.

Per chunk, lag = the client's read time (`time.monotonic_ns()`, taken once per read, the same
stamp the bench's TTFT and ITL use) - the upstream's stamp. CLOCK_MONOTONIC is one clock for
every process on a Linux host, so the lag is the chunk's trip through the kernel plus the time
it waited for the client's event loop. The client's own added latency at N streams is
lag pX at N streams - lag pX at the baseline (`--baseline`, 16 streams), both measured in the
same repeat with the same upstream; repeats alternate the order, and the figure reported is the
median over repeats.

Streams start evenly spread over one interval (an open-loop schedule k x interval / N), so in
steady state N streams are open and N / interval chunks per second arrive spread in time, as
from N independent users. Only chunks read while every stream was open count (from two
intervals after the first send to two intervals before the last chunks are due). The
interval is chosen for the machine: the default, 400 ms, is 1,280 chunks/s at 512 streams,
which this shared 2-core box served within the target every time (200 ms once in three, 100 ms
never: see docs/bench.md); `--interval-ms 400 200 100` measures the curve. It is not a claim
about 512 streams at a GPU's 10 ms ITL (51,200 chunks/s), which no single Python process
reads; the figures say what the client adds at the rate it was given.

Also reported: streams actually open at once, errors, the client's CPU (user+sys of this
process over the run) and per chunk, the upstream's CPU, how late requests were sent against
their schedule, and the machine's other load during the run.

Run: `.venv/bin/python benchmarks/loadgen_capacity.py [--interval-ms 400 200 100]`;
`--quick` is a smoke run (64 streams, one repeat). Writes its JSON (`--json`, by default under
benchmarks/results/, which git ignores).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvloop

from phasewatch.bench.load import Sender, open_loop
from phasewatch.bench.stats import concurrency_max
from phasewatch.bench.workload import client_session, completion_body

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # `python benchmarks/X.py` puts only benchmarks/ there
    sys.path.insert(0, str(HERE.parent))

from benchmarks.proxy_overhead import (  # noqa: E402
    CLK_TCK,
    calibrate,
    proc_cpu_ticks,
    start_upstream,
    stop,
    system_busy_ticks,
)

_ID = b'"id":"'


def stamp_of(payload: bytes) -> int:
    """The upstream's write stamp: the last `-` field of the chunk's id."""
    start = payload.index(_ID) + len(_ID)
    end = payload.index(b'"', start)
    return int(payload[payload.rindex(b"-", start, end) + 1:end])


def quantile(values: Sequence[int], q: float) -> float | None:
    """Nearest-rank quantile in ms."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] / 1e6


async def one_level(url: str, streams: int, interval_s: float, chunks: int) -> dict[str, Any]:
    trace: list[tuple[int, bytes]] = []
    body = completion_body("bench", "hello", chunks)
    async with client_session(streams) as session:
        sender = Sender(session, url + "/v1/completions", body, None, f"capacity-{streams}",
                        trace=lambda now, payload: trace.append((now, payload)))
        offsets = [k * interval_s / streams for k in range(streams)]
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        batch = await open_loop(sender, offsets)
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
    # Steady state: every stream open and started (two intervals after the first send, so late
    # connections are in), and none finished yet (two intervals before the last chunk is due).
    first = batch.start_ns + int(2 * interval_s * 1e9)
    last = batch.start_ns + int((chunks - 2) * interval_s * 1e9)
    lags = [now - stamp_of(payload) for now, payload in trace if first <= now <= last]
    ok = [r for r in batch.results if r.ok]
    cpu_s = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return {
        "streams": streams,
        "ok": len(ok),
        "errors": len(batch.results) - len(ok),
        "concurrency_max": concurrency_max(batch.results),
        "chunks": len(trace),
        "steady_chunks": len(lags),
        "lag_p50_ms": quantile(lags, 0.50),
        "lag_p99_ms": quantile(lags, 0.99),
        "lag_max_ms": max(lags) / 1e6 if lags else None,
        "send_lateness_p99_ms": quantile(batch.lateness_ns, 0.99),
        "client_cpu_s": cpu_s,
        "client_cpu_share": cpu_s / batch.span_s if batch.span_s else None,
        "client_cpu_us_per_chunk": cpu_s / len(trace) * 1e6 if trace else None,
        "span_s": batch.span_s,
    }


def measure(url: str, streams: int, interval_s: float, chunks: int,
            upstream_pid: int) -> dict[str, Any]:
    ticks0, busy0 = proc_cpu_ticks(upstream_pid), system_busy_ticks()
    result = uvloop.run(one_level(url, streams, interval_s, chunks))
    ticks1, busy1 = proc_cpu_ticks(upstream_pid), system_busy_ticks()
    upstream_cpu = (sum(ticks1) - sum(ticks0)) / CLK_TCK if ticks0 and ticks1 else None
    result["upstream_cpu_share"] = upstream_cpu / result["span_s"] if upstream_cpu else None
    if busy0 and busy1 and upstream_cpu is not None:
        machine = (busy1[0] - busy0[0]) / CLK_TCK
        # Everything the machine did besides this client and the upstream (kernel included).
        result["other_cpu_share"] = (machine - upstream_cpu - result["client_cpu_s"]) / (
            result["span_s"])
    return result


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: list[dict[str, Any]], streams: int, baseline: int) -> dict[str, Any]:
    """Per repeat, N-stream figures minus the baseline's; medians over repeats."""
    pairs = [(r["levels"][str(baseline)], r["levels"][str(streams)]) for r in runs]
    added = {
        key: median([load[key] - base[key] for base, load in pairs
                     if load[key] is not None and base[key] is not None])
        for key in ("lag_p50_ms", "lag_p99_ms")
    }
    load_med = {key: median([load[key] for _, load in pairs])
                for key in ("lag_p50_ms", "lag_p99_ms", "client_cpu_share",
                            "client_cpu_us_per_chunk", "upstream_cpu_share", "other_cpu_share",
                            "send_lateness_p99_ms")}
    base_med = {key: median([base[key] for base, _ in pairs])
                for key in ("lag_p50_ms", "lag_p99_ms")}
    return {
        "streams": streams, "baseline_streams": baseline,
        "added_lag_p50_ms": added["lag_p50_ms"], "added_lag_p99_ms": added["lag_p99_ms"],
        "lag_p99_ratio": (load_med["lag_p99_ms"] / base_med["lag_p99_ms"]
                          if load_med["lag_p99_ms"] and base_med["lag_p99_ms"] else None),
        "baseline": base_med, "load": load_med,
        "concurrency_max": min(load["concurrency_max"] for _, load in pairs),
        "errors": sum(load["errors"] + base["errors"] for base, load in pairs),
    }


def fmt(value: float | None, digits: int = 3, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--baseline", type=int, default=16, help="streams of the baseline")
    parser.add_argument("--interval-ms", type=float, nargs="+", default=[400.0],
                        help="per-stream chunk interval(s) (default 400: 1,280 chunks/s at 512 "
                        "streams); several give one row each")
    parser.add_argument("--stream-s", type=float, default=6.0,
                        help="how long each stream lasts (default 6 s; at least 20 chunks)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="64 streams, 1 repeat, 2 s each")
    parser.add_argument("--json", type=Path, help="where to write the results")
    parser.add_argument("--target-ms", type=float, default=1.0,
                        help="the added p99 lag to stay under (default 1 ms)")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.repeats, args.stream_s, args.interval_ms = 64, 1, 2.0, [100.0]
    return args


def one_interval(args: argparse.Namespace, interval_ms: float, tmp: Path) -> dict[str, Any]:
    """Every repeat of baseline and load against one upstream paced at `interval_ms`."""
    interval_s = interval_ms / 1e3
    chunks = max(20, round(args.stream_s / interval_s))
    upstream_args = argparse.Namespace(interval_ms=interval_ms, first_delay_ms=0.0,
                                       chunks=chunks)
    runs: list[dict[str, Any]] = []
    upstream = start_upstream(upstream_args, tmp)
    try:
        for repeat in range(args.repeats):
            order = [args.baseline, args.streams]
            if repeat % 2:
                order.reverse()
            levels = {str(n): measure(upstream.url, n, interval_s, chunks, upstream.proc.pid)
                      for n in order}
            runs.append({"repeat": repeat, "order": order, "levels": levels})
            load, base = levels[str(args.streams)], levels[str(args.baseline)]
            print(f"{interval_ms:g} ms, repeat {repeat + 1}: {args.streams} streams lag p50/p99 "
                  f"{fmt(load['lag_p50_ms'])}/{fmt(load['lag_p99_ms'])} ms, baseline "
                  f"{fmt(base['lag_p50_ms'])}/{fmt(base['lag_p99_ms'])} ms", flush=True)
    finally:
        stop(upstream)
    summary = summarize(runs, args.streams, args.baseline)
    met = (summary["added_lag_p99_ms"] is not None
           and summary["added_lag_p99_ms"] < args.target_ms
           and summary["concurrency_max"] >= args.streams and summary["errors"] == 0)
    return {"interval_ms": interval_ms, "chunks_per_stream": chunks,
            "chunks_per_s": args.streams / interval_s, "summary": summary, "runs": runs,
            "target_met": met}


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(f"\n{args.streams} streams against a baseline of {args.baseline}, median of "
          f"{args.repeats} repeat(s); added = the {args.streams}-stream lag percentile minus the "
          "baseline's, per repeat")
    print(f"{'interval':>9} {'chunks/s':>9} {'open':>5} {'errors':>6} | {'added p50':>9} "
          f"{'added p99':>9} {'base p99':>8} | {'client':>6} {'us/chunk':>8} {'upstream':>8} "
          f"{'others':>6} | {'late p99':>8} | target")
    for row in rows:
        summary, load = row["summary"], row["summary"]["load"]
        print(f"{row['interval_ms']:>7g}ms {row['chunks_per_s']:>9,.0f} "
              f"{summary['concurrency_max']:>5} {summary['errors']:>6} | "
              f"{fmt(summary['added_lag_p50_ms'], sign=True):>9} "
              f"{fmt(summary['added_lag_p99_ms'], sign=True):>9} "
              f"{fmt(summary['baseline']['lag_p99_ms']):>8} | "
              f"{fmt(load['client_cpu_share'], 2):>6} {fmt(load['client_cpu_us_per_chunk'], 1):>8} "
              f"{fmt(load['upstream_cpu_share'], 2):>8} {fmt(load['other_cpu_share'], 2):>6} | "
              f"{fmt(load['send_lateness_p99_ms'], 1):>8} | "
              f"{'met' if row['target_met'] else 'NOT met'}")
    print(f"(lags in ms; client, upstream, others: CPU cores used; target: added p99 < "
          f"{args.target_ms:g} ms with every stream open and no error)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    gc.collect()
    gc.freeze()  # as `phasewatch bench` does before it measures
    with tempfile.TemporaryDirectory(prefix="pw-capacity-") as tmp:
        rows = [one_interval(args, interval, Path(tmp)) for interval in args.interval_ms]
    report(args, rows)
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "calibration": calibrate(), "intervals": rows}
    out = args.json or HERE / "results" / f"loadgen_capacity-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
