"""Python bytecodes per request: the interpreted work of the proxy, counted, not timed.

On a shared VM, CPU time per chunk moves by 10-20% between identical runs and with the host's
load (steal time, a slower core), so a change worth a few percent of a request's Python is
lost in it. An instruction count would not be, but this VM exposes no hardware counters. What
does not move is the number of bytecodes CPython executes for a request: this counts them.

It starts the fast upstream and phasewatch as `proxy_overhead.py` does, with a
`sitecustomize` on phasewatch's path that traces opcodes (`sys.settrace` with
`f_trace_opcodes`, every thread), sends a steady open-loop load (`loadgen.py`), and counts
every opcode executed during a window in the middle of it, per function. Requests are the
calls of `finish` (app/proxy/finish.py) in the window: one per request that ended. It prints
opcodes per request in all, by area (phasewatch's modules, each library), and the functions
that execute the most.

What it does not count: C (uvloop, httptools, orjson, the native relay, SQLite) and the
kernel, so it is not a CPU figure; and tracing slows the process tens of times, so keep the
rate low (the default 10 requests/s). Work that runs per second (the live pass, the
diagnosis schedule, the scrapes) is counted too, spread over the window's requests: at a low
rate it weighs more per request than under the benchmarks' load. Compare two builds at the
same settings (`--source DIR` counts another checkout, e.g. a git worktree of the commit
before a change).

Run: `.venv/bin/python benchmarks/opcode_census.py [--source DIR] [--top 40]`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proxy_overhead import HERE, REPO, source_env, start_phasewatch, start_upstream, stop

# Traces every thread of phasewatch's process; SIGUSR1 starts counting, SIGUSR2 writes the
# counts ("opcodes<TAB>file:line<TAB>function", and "calls" rows for finish) and stops.
_TRACER = '''
import collections, os, signal, sys, threading
_out = os.environ.get("PHASEWATCH_OPCODE_CENSUS")
if _out:
    _ops = collections.Counter()
    _calls = collections.Counter()
    _on = False

    def _trace(frame, event, arg):
        if not _on:
            return None
        code = frame.f_code
        if event == "call":
            frame.f_trace_opcodes = True
            if code.co_name == "finish" and code.co_filename.endswith("proxy/finish.py"):
                _calls[code.co_filename] += 1
        elif event == "opcode":
            _ops[(code.co_filename, code.co_firstlineno, code.co_name)] += 1
        return _trace

    def _start(*_):
        global _on
        _on = True

    def _dump(*_):
        global _on
        _on = False
        with open(_out + ".part", "w") as f:
            f.write(f"calls\\t{sum(_calls.values())}\\tfinish\\n")
            for (path, line, name), n in _ops.most_common():
                f.write(f"{n}\\t{path}:{line}\\t{name}\\n")
        os.replace(_out + ".part", _out)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _dump)
    sys.settrace(_trace)
    threading.settrace(_trace)
'''


def area(path: str, whole: bool = False) -> str:
    """phasewatch's module (`proxy/relay.py`), a library's package (with `whole`, its module's
    path), or the standard library's module."""
    if "site-packages/" in path:
        inside = path.split("site-packages/", 1)[1]
        return inside if whole else inside.split("/", 1)[0]
    parts = Path(path).parts
    for anchor in ("app", "phasewatch"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return "phasewatch/" + "/".join(parts[i + 1:])
    if "python3." in path:
        return "stdlib/" + path.split("/lib/python3.", 1)[1].split("/", 1)[1].split("/")[0]
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=None,
                   help="count another checkout's app/ (e.g. a worktree of the commit before)")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second")
    p.add_argument("--chunks", type=int, default=64, help="content chunks per stream")
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--first-delay-ms", type=float, default=0.0)
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the window")
    p.add_argument("--window", type=float, default=10.0, help="seconds counted")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--client-usage", choices=["none", "final", "continuous"], default="none")
    p.add_argument("--top", type=int, default=30, help="functions listed")
    p.add_argument("--json", type=Path, default=None, help="also write the counts here")
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = p.parse_args()
    if args.quick:
        args.warmup, args.window, args.chunks = 1.0, 2.0, 8

    with tempfile.TemporaryDirectory(prefix="pw-census-") as tmp_name:
        tmp = Path(tmp_name)
        hook = tmp / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_TRACER)
        census = tmp / "census.tsv"
        paths = [str(hook)]
        if args.source is not None:
            paths.append(source_env(args.source, tmp)["PYTHONPATH"])
        env = {"PYTHONPATH": os.pathsep.join(paths), "PHASEWATCH_OPCODE_CENSUS": str(census)}
        upstream = start_upstream(args, tmp)
        proxy = None
        try:
            proxy = start_phasewatch(upstream, tmp, extra_env=env)
            stream_s = args.first_delay_ms / 1000 + args.chunks * args.interval_ms / 1000
            load = subprocess.Popen([
                sys.executable, str(HERE / "loadgen.py"), "--url", proxy.url,
                "--endpoint", args.endpoint, "--client-usage", args.client_usage,
                "--tokens", str(args.chunks), "--interval-ms", str(args.interval_ms),
                "--rate", str(args.rate), "--duration",
                str(args.warmup + args.window + stream_s), "--out", str(tmp / "load.json"),
            ], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            time.sleep(args.warmup + stream_s)  # past the ramp: as many end as start
            os.kill(proxy.proc.pid, signal.SIGUSR1)
            time.sleep(args.window)
            os.kill(proxy.proc.pid, signal.SIGUSR2)
            deadline = time.monotonic() + 60
            while not census.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            load.wait(timeout=args.warmup + args.window + stream_s + 120)
            if not census.exists():
                raise SystemExit("phasewatch wrote no census (is its sitecustomize shadowed?)")
            report(census.read_text(), args)
        finally:
            if proxy is not None:
                stop(proxy)
            stop(upstream)


def report(text: str, args: argparse.Namespace) -> None:
    lines = [line.split("\t") for line in text.splitlines()]
    requests = int(lines[0][1])
    if not requests:
        raise SystemExit("no request ended in the window")
    rows = [(int(n), where, name) for n, where, name in lines[1:]]
    total = sum(n for n, _, _ in rows)
    by_area: collections.Counter[str] = collections.Counter()
    for n, where, _ in rows:
        by_area[area(where.rsplit(":", 1)[0])] += n
    if args.json is not None:
        args.json.write_text(json.dumps({
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "requests": requests, "opcodes_per_request": total / requests,
            "areas": {name: n / requests for name, n in by_area.most_common()},
            "functions": [{"where": f"{area(where.rsplit(':', 1)[0], whole=True)}:"
                                    f"{where.rsplit(':', 1)[1]}", "name": name,
                           "per_request": n / requests} for n, where, name in rows[:args.top]],
        }, indent=1))
    print(f"phasewatch opcode census: {args.rate:g} requests/s, {args.chunks} chunks every "
          f"{args.interval_ms:g} ms, /{args.endpoint}, client usage {args.client_usage}"
          + (f", source {args.source}" if args.source else ""))
    print(f"  {requests} requests ended in the {args.window:g} s window; "
          f"{total / requests:,.0f} opcodes per request\n")
    print("by area (opcodes per request, share)")
    for name, n in by_area.most_common(20):
        print(f"  {n / requests:9,.0f}  {100 * n / total:5.1f}%  {name}")
    print(f"\ntop {args.top} functions (opcodes per request)")
    for n, where, name in rows[:args.top]:
        path, line = where.rsplit(":", 1)
        print(f"  {n / requests:9,.0f}  {area(path, whole=True)}:{line} {name}")


if __name__ == "__main__":
    main()
