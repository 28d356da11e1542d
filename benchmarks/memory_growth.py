"""Does phasewatch's memory stay flat under ordinary traffic? RSS and open descriptors of a
`phasewatch serve` process over many streamed requests on kept connections.

It starts the fast fake vLLM (fast_upstream.py) and `python -m phasewatch.cli serve` in front of
it (its defaults: the native relay on), then sends `--requests` streamed completions over
`--connections` kept-alive connections (each connection one request after another), and reads
the server's RSS (`/proc/PID/status` VmRSS) and its open descriptors (`/proc/PID/fd`) after
`--warm` requests and at the end. Every response is checked whole (its `[DONE]` and the
chunked body's end). Prints the growth from the warm point to the end, in MB and in bytes per
request; `--max-growth-mb` makes a growth past it exit 1.

Run: `.venv/bin/python benchmarks/memory_growth.py [--requests 40000] [--connections 8]`
(`--quick`: 3,000 requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # `python benchmarks/X.py` puts only benchmarks/ there
    sys.path.insert(0, str(HERE.parent))

from benchmarks.proxy_overhead import start_phasewatch, start_upstream, stop  # noqa: E402

REQUEST_BODY = orjson.dumps({"model": "m", "prompt": "hello", "stream": True, "max_tokens": 8,
                             "x_interval_ms": 0})


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _one_connection(port: int, count: int, done: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%b" % (len(REQUEST_BODY), REQUEST_BODY))
    try:
        for _ in range(count):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"answered {head[:40]!r}")
            body = await reader.readuntil(b"0\r\n\r\n")
            if b"data: [DONE]" not in body:
                raise RuntimeError("a stream without [DONE]")
            done[0] += 1
    finally:
        writer.close()


async def drive(port: int, requests: int, connections: int) -> None:
    done = [0]
    per = [requests // connections + (1 if i < requests % connections else 0)
           for i in range(connections)]
    await asyncio.gather(*(_one_connection(port, n, done) for n in per if n))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40_000)
    parser.add_argument("--warm", type=int, default=1_000)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="3,000 requests, 500 to warm")
    parser.add_argument("--max-growth-mb", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--env", action="append", default=[],
                        help="NAME=VALUE for the served process (e.g. a setting)")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.warm = 3_000, 500
    shape = argparse.Namespace(interval_ms=0.0, first_delay_ms=0.0, chunks=8)
    with tempfile.TemporaryDirectory() as tmpname:
        tmp = Path(tmpname)
        upstream = start_upstream(shape, tmp)
        try:
            served = start_phasewatch(upstream, tmp, extra_env=dict(
                item.split("=", 1) for item in args.env))
            try:
                pid, port = served.proc.pid, served.port
                started = time.monotonic()
                asyncio.run(drive(port, args.warm, args.connections))
                warm_rss, warm_fds = rss_mb(pid), open_fds(pid)
                asyncio.run(drive(port, args.requests - args.warm, args.connections))
                end_rss, end_fds = rss_mb(pid), open_fds(pid)
                took = time.monotonic() - started
            finally:
                stop(served)
        finally:
            stop(upstream)
    growth = end_rss - warm_rss
    per_request = growth * 1024 * 1024 / max(1, args.requests - args.warm)
    print(f"{args.requests} requests on {args.connections} kept connections in {took:.0f} s")
    print(f"RSS after {args.warm}: {warm_rss:.1f} MB; after {args.requests}: {end_rss:.1f} MB; "
          f"growth {growth:+.1f} MB ({per_request:+.0f} bytes per request)")
    print(f"open descriptors after {args.warm}: {warm_fds}; after {args.requests}: {end_fds}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "requests": args.requests, "warm": args.warm, "connections": args.connections,
            "warm_rss_mb": warm_rss, "end_rss_mb": end_rss, "growth_mb": growth,
            "bytes_per_request": per_request, "warm_fds": warm_fds, "end_fds": end_fds}))
    if args.max_growth_mb is not None and growth > args.max_growth_mb:
        print(f"growth past {args.max_growth_mb} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
