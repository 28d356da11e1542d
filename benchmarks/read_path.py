"""The relay's per-read work in one process, without sockets or an event loop.

`proxy_overhead.py` measures what a relayed chunk costs the whole proxy process; this measures
the part that is phasewatch's own Python, so a change to the hot path can be judged in seconds
and without the machine's noise. Each upstream read (a vLLM-shaped completions chunk with
running usage, framed as HTTP/1.1 chunked encoding) goes through what the relay runs in the
upstream connection's read callback:

- `pass-through`: the upstream connection (`UpstreamConnection.data_received`, httptools) and
  the client framing (`b"%x\\r\\n%b\\r\\n"`) only: the floor of the per-read path;
- `phasewatch`: the same plus the stream feed (`StreamFeed.feed`: event split, token-chunk
  read, running usage stripped as for a client that did not ask for it, `StreamTiming`, ITL
  into the bound histogram, exemplars on). `--client-usage continuous`: nothing is stripped.

Streams are fed interleaved (`--streams` at a time, one read each in turn), as the event loop
interleaves them. Reported: CPU time per read (`time.process_time_ns`), median over
`--repeats`, and phasewatch's as a ratio of the pass-through's, measured in the same run.
What this leaves out (the event loop, the system calls, per-request work, periodic duties) is
what `proxy_overhead.py` adds; docs/benchmarks.md compares the two.

Run: `.venv/bin/python benchmarks/read_path.py [--streams 256] [--repeats 7]`; `--quick`: a
smoke run of a second or two. Installs nothing and writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry

from phasewatch.core.metrics import ProxyMetrics, request_exemplar
from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.proxy.request_plan import plan_request
from phasewatch.proxy.stream import StreamFeed
from phasewatch.proxy.timing import StreamTiming
from phasewatch.proxy.upstream_pool import ConnState, UpstreamConnection

PROMPT_TOKENS = 100
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def _usage(completion: int) -> bytes:
    return b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}' % (
        PROMPT_TOKENS, PROMPT_TOKENS + completion, completion)


def _frame(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


def stream_reads(tokens: int) -> list[bytes]:
    """One response as the upstream's reads: the head, a chunk per token, usage, [DONE]."""
    head = b'{"id":"cmpl-7","object":"text_completion","created":1764633600,"model":"m",'
    reads = [HEAD]
    for i in range(tokens):
        finish = b'"length"' if i == tokens - 1 else b"null"
        reads.append(_frame(
            b'data: %b"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":%b,'
            b'"stop_reason":null}],"usage":%b}\n\n' % (head, finish, _usage(i + 1))))
    reads.append(_frame(b'data: %b"choices":[],"usage":%b}\n\n' % (head, _usage(tokens))))
    reads.append(_frame(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return reads


class _Pool:
    def put_back(self, conn: UpstreamConnection) -> None:
        pass

    def forget(self, conn: UpstreamConnection) -> None:
        pass


class _Client:
    """The client's transport: takes the bytes, as `transport.write` would."""

    written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)


class PassThrough:
    """Upstream handler: frames each read's body for the client, nothing else."""

    def __init__(self, client: _Client) -> None:
        self.write = client.write

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        pass

    def on_body(self, data: bytes, now_ns: int) -> None:
        self.write(b"%x\r\n%b\r\n" % (len(data), data))

    def on_end(self, now_ns: int) -> None:
        pass

    def on_lost(self, reason: str, responded: bool) -> None:
        pass

    def on_read_end(self) -> None:
        pass


class Timed(PassThrough):
    """Upstream handler: the relay's streaming branch (`Exchange.on_body`): feed, then frame."""

    def __init__(self, client: _Client, metrics: ProxyMetrics, body: bytes) -> None:
        super().__init__(client)
        record = RequestRecord(
            request_id="r" * 32, started_at=datetime.now(UTC), endpoint="completions",
            model="m", upstream="bench", stream=True, outcome=Outcome.OK, http_status=None,
            in_flight_at_arrival=0)
        timing = StreamTiming(time.perf_counter_ns())
        bound = metrics.bind("m", "completions")
        timing.observe_ttft, timing.observe_itl = bound.observe_ttft, bound.observe_itl
        timing.exemplar = request_exemplar(record.request_id, None)
        self.feed = StreamFeed(plan_request(body, True), record, timing)

    def on_body(self, data: bytes, now_ns: int) -> None:
        out = self.feed.feed(data, now_ns)
        if out:
            self.write(b"%x\r\n%b\r\n" % (len(out), out))


def run_streams(make: Callable[[], PassThrough], reads: list[bytes], streams: int) -> int:
    """Feed `streams` responses interleaved; the CPU time it took, in ns."""
    conns = []
    for _ in range(streams):
        conn = UpstreamConnection(_Pool())  # type: ignore[arg-type]
        conn.state = ConnState.BUSY
        conn._handler = make()  # what `send` sets, without a transport
        conns.append(conn)
    start = time.process_time_ns()
    for read in reads:
        for conn in conns:
            conn.data_received(read)
    return time.process_time_ns() - start


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256, help="streams fed interleaved")
    p.add_argument("--tokens", type=int, default=64, help="token chunks per stream")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--client-usage", choices=["none", "continuous"], default="none",
                   help="none: the running usage phasewatch asked for is stripped (default)")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 streams, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.repeats = 16, 2
    options = (b',"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
               if args.client_usage == "continuous" else b"")
    body = b'{"model":"m","prompt":"x","stream":true,"max_tokens":%d%b}' % (args.tokens, options)
    reads = stream_reads(args.tokens)
    client = _Client()
    metrics = ProxyMetrics(CollectorRegistry(), slo_ttft_s=0.5, slo_itl_s=0.04)
    paths: dict[str, Callable[[], PassThrough]] = {
        "pass-through": lambda: PassThrough(client),
        "phasewatch": lambda: Timed(client, metrics, body),
    }
    per_read: dict[str, list[float]] = {name: [] for name in paths}
    n_reads = len(reads) * args.streams
    for make in paths.values():  # warm up
        run_streams(make, reads, args.streams)
    for _ in range(args.repeats):
        for name, make in paths.items():
            per_read[name].append(run_streams(make, reads, args.streams) / n_reads / 1000)
    print(f"phasewatch read path, in process: {args.streams} streams interleaved, "
          f"{len(reads)} reads each ({args.tokens} token chunks), client usage "
          f"{args.client_usage}; Python {sys.version.split()[0]}")
    floor = statistics.median(per_read["pass-through"])
    for name, values in per_read.items():
        median = statistics.median(values)
        print(f"  {name:<13} {median:6.2f} us per read (min {min(values):.2f}, "
              f"{args.repeats} repeats)  {median / floor:5.2f}x pass-through")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
