"""Open-loop load generator for the overhead benchmark: Poisson arrivals of streamed requests.

One process (or one shard of several) of an aiohttp client on uvloop. Arrivals follow a fixed
schedule drawn from `--seed`: exponential gaps at `--rate` requests per second for
`--duration` seconds, whatever the server does (open loop: a slow server gets more concurrent
streams, it does not slow the arrivals down). The same seed gives the same schedule on every
path, so direct, phasewatch and nginx see identical load.

Per request it measures, on CLOCK_MONOTONIC (`time.monotonic_ns()`, one clock for every
process on the host):
- TTFT: just before the request is handed to aiohttp -> the read that delivered the first
  event carrying output (text or delta content; a chat role chunk is not output);
- each content chunk's lag: the read that delivered it -> the upstream's write stamp inside
  the chunk's `id` (see fast_upstream.py). Several events in one read share that read's time.
Requests that arrive during the first `--warmup` seconds are run but not measured (the system
is still filling up to its steady concurrency). Every event is counted, measured or not, so
the caller can divide a proxy's CPU time by every chunk it relayed.

It also checks what it receives: every stream must end with `[DONE]` after the expected number
of content chunks, and must carry usage only as the client asked (`--client-usage`), which is
what phasewatch promises when it adds `stream_options` upstream. It reports its own CPU time
and how late it sent requests against the schedule, so a saturated generator shows itself.

It writes raw samples as JSON to `--out`; the caller merges shards and computes percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import resource
import time
from typing import Any

import aiohttp
import orjson
import uvloop

# The bench's own Poisson schedule: one definition for `phasewatch bench rate` and this script.
from phasewatch.bench.load import poisson_schedule

_HEADERS = {"Content-Type": "application/json"}


class Results:
    """Raw samples and counters for one shard; nanoseconds throughout."""

    def __init__(self) -> None:
        self.ttft_ns: list[int] = []
        self.lag_ns: list[int] = []
        self.lateness_ns: list[int] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.scheduled = 0
        self.measured = 0
        self.ok = 0
        self.content_chunks = 0  # every request, measured or not
        # Content chunks received within [window_ns[0], window_ns[1]) (CLOCK_MONOTONIC): the
        # arrivals after the warm-up, while the streams are all open (`run`).
        self.window_ns = (0, 0)
        self.window_chunks = 0
        self.events = 0  # every `data:` event received, [DONE] included
        self.in_flight = 0
        self.max_in_flight = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "ttft_ns": self.ttft_ns,
            "lag_ns": self.lag_ns,
            "lateness_ns": self.lateness_ns,
            "errors": dict(self.errors),
            "scheduled": self.scheduled,
            "measured": self.measured,
            "ok": self.ok,
            "content_chunks": self.content_chunks,
            "window_ns": list(self.window_ns),
            "window_chunks": self.window_chunks,
            "events": self.events,
            "max_in_flight": self.max_in_flight,
        }


def request_body(chat: bool, tokens: int, client_usage: str,
                 interval_ms: float | None = None) -> bytes:
    body: dict[str, Any] = {"model": "bench", "max_tokens": tokens, "stream": True}
    if interval_ms:  # fast_upstream.py's per-request decode pace
        body["x_interval_ms"] = interval_ms
    if chat:
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    if client_usage != "none":
        body["stream_options"] = {
            "include_usage": True, "continuous_usage_stats": client_usage == "continuous",
        }
    return orjson.dumps(body)


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    chat: bool,
    tokens: int,
    client_usage: str,
    measured: bool,
    res: Results,
) -> None:
    lags: list[int] = []
    first_ns: int | None = None
    content = 0
    done = False
    saw_final_usage = False
    violation: str | None = None
    tail = b""
    res.in_flight += 1
    res.max_in_flight = max(res.max_in_flight, res.in_flight)
    sent_ns = time.monotonic_ns()
    try:
        async with session.post(url, data=body, headers=_HEADERS) as resp:
            if resp.status != 200:
                await resp.read()
                res.errors[f"http_{resp.status}"] += 1
                return
            async for data in resp.content.iter_any():
                now = time.monotonic_ns()
                events = (tail + data if tail else data).split(b"\n\n")
                tail = events.pop()
                for event in events:
                    if not event.startswith(b"data: "):
                        continue
                    res.events += 1
                    payload = event[6:]
                    if payload == b"[DONE]":
                        done = True
                        continue
                    obj = orjson.loads(payload)
                    usage = obj.get("usage")
                    choices = obj.get("choices")
                    if not choices:
                        saw_final_usage = saw_final_usage or usage is not None
                        if obj.get("error") is not None:
                            violation = "in_band_error"
                        continue
                    if usage is not None and client_usage != "continuous":
                        violation = "usage_not_asked_for"
                    choice = choices[0]
                    text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                    if not text:
                        continue
                    content += 1
                    if res.window_ns[0] <= now < res.window_ns[1]:
                        res.window_chunks += 1
                    if first_ns is None:
                        first_ns = now
                    lags.append(now - int(obj["id"].rsplit("-", 1)[1]))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        res.errors[type(exc).__name__] += 1
        return
    finally:
        res.in_flight -= 1
        res.content_chunks += content
    if saw_final_usage != (client_usage != "none"):
        violation = violation or "final_usage_mismatch"
    if not done or content != tokens or first_ns is None:
        violation = violation or "incomplete_stream"
    if violation is not None or first_ns is None:
        res.errors[violation or "incomplete_stream"] += 1
        return
    res.ok += 1
    if measured:
        res.measured += 1
        res.ttft_ns.append(first_ns - sent_ns)
        res.lag_ns.extend(lags)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    res = Results()
    chat = args.endpoint == "chat"
    url = args.url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    body = request_body(chat, args.tokens, args.client_usage, args.interval_ms)
    arrivals = [
        t for i, t in enumerate(poisson_schedule(args.rate, args.duration, args.seed))
        if i % args.shards == args.shard
    ]
    res.scheduled = len(arrivals)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=30)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as session:
        # All shards start at the same instant, chosen by the caller on the shared clock.
        wait_s = (args.start_at_ns - time.monotonic_ns()) / 1e9
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        start = loop.time()
        wall0 = time.monotonic_ns()
        origin = args.start_at_ns or wall0  # the shards' shared start, as the caller has it
        res.window_ns = (origin + int(args.warmup * 1e9), origin + int(args.duration * 1e9))
        tasks: list[asyncio.Task[None]] = []
        for offset in arrivals:
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            res.lateness_ns.append(max(0, int((loop.time() - start - offset) * 1e9)))
            tasks.append(loop.create_task(one_request(
                session, url, body, chat, args.tokens, args.client_usage,
                offset >= args.warmup, res,
            )))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
                res.errors["unfinished"] += len(pending)
        wall_s = (time.monotonic_ns() - wall0) / 1e9
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
    out = res.as_json()
    out["cpu_s"] = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    out["wall_s"] = wall_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--client-usage", choices=["none", "final", "continuous"],
                        default="none", help="stream_options the client sends")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    parser.add_argument("--interval-ms", type=float, default=None,
                        help="ask fast_upstream.py for this gap between chunks (default: its own)")
    parser.add_argument("--rate", type=float, required=True, help="arrivals per second")
    parser.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    parser.add_argument("--warmup", type=float, default=0.0,
                        help="arrivals before this many seconds are not measured")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--start-at-ns", type=int, default=0,
                        help="time.monotonic_ns() at which the schedule starts")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="seconds to wait for streams after the last arrival")
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    args = parser.parse_args()
    result = uvloop.run(run(args))
    with open(args.out, "wb") as f:
        f.write(orjson.dumps(result))


if __name__ == "__main__":
    main()
