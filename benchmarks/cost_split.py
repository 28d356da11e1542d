"""A proxy's CPU split into what it costs per request and what it costs per chunk.

`proxy_overhead.py` reports CPU per relayed chunk at one stream length (`--chunks`, 64 by
default): the cost of a request (parsing it, opening the upstream exchange, the response's
head, the record) is spread over that stream's chunks. A proxy whose per-request cost is high
looks expensive on short streams and cheap on long ones, so one length cannot tell which of
the two costs a change moved, nor what the proxy costs on another workload.

This runs `proxy_overhead.py` at the same concurrency and chunk rate for each of several
stream lengths (`--chunks 64 256`: alternating within each repeat, so a drift of the machine
lands on both), and fits, per path and per repeat,

    CPU per chunk = per request / chunks per stream + per chunk

(exact for two lengths, least squares for more). At equal chunk rate, work that runs per
second (the diagnosis schedule, the live pass, the metrics) lands in the per-chunk term. It
prints the median of each term over repeats, nginx's beside phasewatch's, and the ratio to
nginx that follows at a few stream lengths.

Run: `.venv/bin/python benchmarks/cost_split.py [--concurrency 256] [--chunks 64 256]
[--repeats 2] [-- extra proxy_overhead.py flags]`. Each run is one `proxy_overhead.py` run of
one repeat (direct, phasewatch and nginx); results go to `--json` (default under
benchmarks/results/, which git ignores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PATHS = ("phasewatch", "nginx")
SHOWN_LENGTHS = (64, 256, 1024)


def fit(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(per request, per chunk) from (chunks per stream, CPU per chunk) points: the least
    squares line of CPU per chunk against 1 / chunks."""
    xs = [1.0 / chunks for chunks, _ in points]
    ys = [cpu for _, cpu in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def one_run(args: argparse.Namespace, chunks: int, repeat: int, out: Path) -> dict[str, Any]:
    """CPU per chunk of each path in one `proxy_overhead.py` run."""
    result = out / f"c{args.concurrency}-n{chunks}-r{repeat}.json"
    cmd = [sys.executable, str(HERE / "proxy_overhead.py"), "--concurrency",
           str(args.concurrency), "--chunk-rate", str(args.chunk_rate), "--chunks", str(chunks),
           "--repeats", "1", "--seed", str(args.seed + repeat), "--json", str(result),
           *args.extra]
    started = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(result.read_text())["summary"][str(args.concurrency)]
    cpu = {path: summary[path]["proxy_cpu_us_per_chunk"] for path in PATHS if path in summary}
    print(f"  repeat {repeat + 1}, {chunks} chunks per stream: "
          + ", ".join(f"{path} {value:.1f} us/chunk" for path, value in cpu.items()
                      if value is not None)
          + f" ({time.monotonic() - started:.0f} s)", flush=True)
    return {"chunks": chunks, "repeat": repeat, "cpu_us_per_chunk": cpu}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--chunk-rate", type=float, default=3200.0)
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 256],
                   help="stream lengths, at least two (default 64 256)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("extra", nargs="*", help="after --: flags passed to proxy_overhead.py")
    args = p.parse_args(argv)
    if len(set(args.chunks)) < 2:
        p.error("--chunks needs at least two different stream lengths")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"cost split at {args.concurrency} streams, {args.chunk_rate:,.0f} chunks/s, stream "
          f"lengths {args.chunks}, {args.repeats} repeat(s)", flush=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="phasewatch-split-") as tmp:
        for repeat in range(args.repeats):
            order = args.chunks if repeat % 2 == 0 else list(reversed(args.chunks))
            runs += [one_run(args, chunks, repeat, Path(tmp)) for chunks in order]
    split: dict[str, dict[str, float]] = {}
    for path in PATHS:
        fits = []
        for repeat in range(args.repeats):
            points = [(r["chunks"], r["cpu_us_per_chunk"].get(path)) for r in runs
                      if r["repeat"] == repeat]
            if all(cpu is not None for _, cpu in points):
                fits.append(fit([(n, float(c)) for n, c in points if c is not None]))
        if fits:
            split[path] = {"per_request_us": statistics.median(f[0] for f in fits),
                           "per_chunk_us": statistics.median(f[1] for f in fits)}
    print(f"\n{'path':<12}{'per request':>14}{'per chunk':>12}"
          + "".join(f"{f'at {n} chunks':>15}" for n in SHOWN_LENGTHS))
    for path, s in split.items():
        at = [s["per_request_us"] / n + s["per_chunk_us"] for n in SHOWN_LENGTHS]
        print(f"{path:<12}{s['per_request_us']:>11,.0f} us{s['per_chunk_us']:>9.1f} us"
              + "".join(f"{v:>12.1f} us" for v in at))
    if len(split) == len(PATHS):
        pw, ng = split["phasewatch"], split["nginx"]
        ratios = [(pw["per_request_us"] / n + pw["per_chunk_us"])
                  / (ng["per_request_us"] / n + ng["per_chunk_us"]) for n in SHOWN_LENGTHS]
        print(f"{'ratio':<12}{pw['per_request_us'] / ng['per_request_us']:>13.1f}x"
              f"{pw['per_chunk_us'] / ng['per_chunk_us']:>11.2f}x"
              + "".join(f"{r:>14.2f}x" for r in ratios))
    out = args.json or HERE / "results" / f"cost_split-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json"},
                               "runs": runs, "split": split}, indent=2, default=str))
    print(f"\nresults written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
