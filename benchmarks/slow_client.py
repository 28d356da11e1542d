"""Does a client that stops reading slow anyone but itself? Chunk lag of 20 streams through
phasewatch with and without one stalled client beside them, in one run.

It starts the fast fake vLLM (fast_upstream.py) and `python -m phasewatch.cli serve` in front of
it (the native relay on, the client stall timeout past the run), then alternates two phases of
`--seconds` each, `--repeats` times: 20 (`--streams`) clients each streaming 64-token
completions back to back on a kept connection (a token every 20 ms), alone; and the same with
one more client that asks for a 100,000-token stream as fast as the upstream writes it, and
reads nothing (its receive buffer set small, so every buffer between fills at once). Each
content chunk's lag is its read time minus the upstream's write stamp in its `id` (one
CLOCK_MONOTONIC for every process). Prints the 20 streams' lag p50 and p99 per phase, and the
median over repeats of (p99 with the stalled client - p99 without). Target: within 1 ms.

Run: `.venv/bin/python benchmarks/slow_client.py [--repeats 3] [--seconds 20]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # `python benchmarks/X.py` puts only benchmarks/ there
    sys.path.insert(0, str(HERE.parent))

from benchmarks.proxy_overhead import start_phasewatch, start_upstream, stop  # noqa: E402

_STAMP = re.compile(rb'"id":"cmpl-\d+-(\d+)"')


def _request(body: dict[str, object]) -> bytes:
    data = orjson.dumps(body)
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(data), data))


async def _steady(port: int, until: float, lags: list[int]) -> None:
    """Streams back to back on one kept connection until `until`; each chunk's lag (ns)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = _request({"model": "m", "prompt": "x", "stream": True, "max_tokens": 64,
                        "x_interval_ms": 20})
    try:
        while time.monotonic() < until:
            writer.write(request)
            await reader.readuntil(b"\r\n\r\n")
            tail = b""  # the body's last bytes: it ends with the empty chunk
            while tail != b"0\r\n\r\n":
                data = await reader.read(65536)
                if not data:
                    raise RuntimeError("the proxy closed a steady stream")
                now = time.monotonic_ns()
                tail = (tail + data)[-5:]
                lags.extend(now - int(stamp) for stamp in _STAMP.findall(data))
    finally:
        writer.close()


def _stall(port: int) -> socket.socket:
    """A client that asks for a long, fast stream and reads nothing of it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(_request({"model": "m", "prompt": "x", "stream": True, "max_tokens": 100_000,
                           "x_interval_ms": 0}))
    return sock


def _percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(q * len(ordered)) - 1))] / 1e6


async def _phase(port: int, streams: int, seconds: float) -> list[int]:
    lags: list[int] = []
    until = time.monotonic() + seconds
    await asyncio.gather(*(_steady(port, until, lags) for _ in range(streams)))
    return lags


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat of 4 s phases")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.seconds = 1, 4.0
    rows: list[dict[str, float]] = []
    shape = argparse.Namespace(interval_ms=20.0, first_delay_ms=0.0, chunks=64)
    with tempfile.TemporaryDirectory() as tmpname:
        tmp = Path(tmpname)
        upstream = start_upstream(shape, tmp)
        served = None
        try:
            served = start_phasewatch(upstream, tmp,
                                      extra_env={"PHASEWATCH_CLIENT_STALL_TIMEOUT_S": "3600"})
            port = served.port
            asyncio.run(_phase(port, args.streams, 2.0))  # connections and caches warm
            for repeat in range(args.repeats):
                alone = asyncio.run(_phase(port, args.streams, args.seconds))
                stalled = _stall(port)
                try:
                    beside = asyncio.run(_phase(port, args.streams, args.seconds))
                finally:
                    stalled.close()
                row = {"repeat": repeat, "alone_p50_ms": _percentile(alone, 0.5),
                       "alone_p99_ms": _percentile(alone, 0.99),
                       "beside_p50_ms": _percentile(beside, 0.5),
                       "beside_p99_ms": _percentile(beside, 0.99),
                       "chunks_alone": len(alone), "chunks_beside": len(beside)}
                rows.append(row)
                print(f"repeat {repeat}: lag p50/p99 alone {row['alone_p50_ms']:.2f}/"
                      f"{row['alone_p99_ms']:.2f} ms; beside a stalled client "
                      f"{row['beside_p50_ms']:.2f}/{row['beside_p99_ms']:.2f} ms "
                      f"({len(alone)} and {len(beside)} chunks)")
        finally:
            for server in (served, upstream):
                if server is not None:
                    stop(server)
    added = statistics.median(r["beside_p99_ms"] - r["alone_p99_ms"] for r in rows)
    print(f"lag p99 with the stalled client minus without, median of {len(rows)}: "
          f"{added:+.2f} ms (target: within 1 ms)")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "added_p99_ms": added}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
