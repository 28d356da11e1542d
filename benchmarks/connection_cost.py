"""What a new client connection costs a proxy, against the same requests kept alive; nginx beside.

At many concurrent streams a proxy opens a client connection (and, for phasewatch, an upstream
one) for each stream the fill-up adds, and a client that does not keep its connections alive
opens one per request. `proxy_overhead.py` folds that into CPU per chunk; this isolates it.
For each proxy (phasewatch, and nginx as `proxy_overhead.py` configures it), in alternating
rounds: `--requests` streamed requests one after another on one kept-alive connection, then as
many again each on a new connection (closed by the client after its response). The proxy's CPU
per request both ways is read from /proc; the difference is what a connection costs. Streams
are short (`--chunks`, 1 ms apart) so the connections weigh against little relaying.

Run: `.venv/bin/python benchmarks/connection_cost.py [--rounds 3] [--requests 1500]`.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy_overhead import (
    CLK_TCK,
    DEFAULT_NGINX,
    HERE,
    Server,
    median,
    raise_fd_limit,
    start_nginx,
    start_phasewatch,
    start_upstream,
    stop,
)
from proxy_overhead import parse_args as overhead_args

_BODY = b'{"model":"m","prompt":"hi","max_tokens":4,"stream":true}'
_REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%b" % (len(_BODY), _BODY)
)


def exchange(sock: socket.socket) -> None:
    """One streamed request, read to the chunked body's end."""
    sock.sendall(_REQUEST)
    tail = b""
    while True:
        data = sock.recv(65536)
        if not data:
            raise RuntimeError("the proxy closed the connection mid-response")
        tail = (tail + data)[-5:]
        if tail == b"0\r\n\r\n":
            return


def cpu_s(server: Server) -> float:
    ticks = server.cpu_ticks()
    if ticks is None:
        raise RuntimeError(f"{server.name} is gone")
    return (ticks[0] + ticks[1]) / CLK_TCK


def one_round(server: Server, requests: int) -> dict[str, float]:
    """CPU per request kept alive and on new connections, in microseconds."""
    address = ("127.0.0.1", server.port)
    with socket.create_connection(address) as sock:
        exchange(sock)  # the connection and the upstream's are open before the count
        start = cpu_s(server)
        for _ in range(requests):
            exchange(sock)
        kept = cpu_s(server) - start
    start = cpu_s(server)
    for _ in range(requests):
        with socket.create_connection(address) as sock:
            exchange(sock)
    fresh = cpu_s(server) - start
    return {
        "kept_alive_us": kept / requests * 1e6,
        "new_connection_us": fresh / requests * 1e6,
        "per_connection_us": (fresh - kept) / requests * 1e6,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=1500, help="requests each way per round")
    p.add_argument("--chunks", type=int, default=4, help="content chunks per stream")
    p.add_argument("--nginx", default=DEFAULT_NGINX)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 300 requests")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.requests = 1, 300
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    upstream_args = overhead_args(
        ["--chunks", str(args.chunks), "--chunk-rate", "0", "--interval-ms", "1"]
    )
    servers: list[Server] = []
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="connection-cost-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            upstream = start_upstream(upstream_args, tmp)
            servers.append(upstream)
            proxies = [start_phasewatch(upstream, tmp)]
            if Path(args.nginx).exists():
                proxies.append(start_nginx(args.nginx, upstream, tmp))
            else:
                print(f"nginx not found at {args.nginx}: phasewatch alone")
            servers += proxies
            for index in range(args.rounds):
                for proxy in proxies if index % 2 == 0 else proxies[::-1]:
                    figures = one_round(proxy, args.requests)
                    results.setdefault(proxy.name, []).append(figures)
                    print(
                        f"round {index + 1} {proxy.name:10s} kept alive "
                        f"{figures['kept_alive_us']:6.0f} us/request, new connection "
                        f"{figures['new_connection_us']:6.0f}: a connection "
                        f"{figures['per_connection_us']:+5.0f} us"
                    )
        finally:
            for server in servers:
                stop(server)
    summary: dict[str, Any] = {
        name: {key: median([r[key] for r in rounds]) for key in rounds[0]}
        for name, rounds in results.items()
    }
    print(
        f"medians over {args.rounds} round(s) of {args.requests} requests each way "
        f"({args.chunks}-chunk streams; CPU of the proxy's process):"
    )
    for name, figures in summary.items():
        print(
            f"  {name:10s} kept alive {figures['kept_alive_us']:6.0f} us/request, a new "
            f"connection {figures['per_connection_us']:+5.0f} us"
        )
    if "phasewatch" in summary and "nginx" in summary:
        for key, what in (
            ("kept_alive_us", "per request kept alive"),
            ("per_connection_us", "per new connection"),
        ):
            ours, theirs = summary["phasewatch"][key], summary["nginx"][key]
            if ours is not None and theirs:
                print(f"  phasewatch / nginx, {what}: {ours / theirs:.1f}x")
    out = args.json or HERE / "results" / "connection_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rounds": results, "summary": summary}, indent=2))
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
