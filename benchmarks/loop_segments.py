"""The event loop's CPU per request, segment by segment, measured in the served process.

`proxy_overhead.py` says how much CPU a relayed chunk costs and which thread spends it;
`opcode_census.py` says which Python runs, but not what it costs. This says where the event
loop's CPU time goes, in the running server under the benchmark's load: it wraps the steps a
request goes through, and the periodic duties, with the thread's CPU clock
(`time.thread_time_ns`, user and kernel) before and after each, and divides by the requests
that ended in the window. The segments are disjoint and all on the event loop's thread:

- `intake`: the client's bytes read by the server protocol (`PhasewatchHttpProtocol
  .data_received`): uvicorn's parse, the ASGI scope, the request's task created;
- `request out`: the relay coroutine's first step, from its start to its first sleep: the
  body, the plan, the record, the exchange, the upstream request written, the native leg's
  start (with, nested in it and listed under it, the calls named there);
- `relay, middle steps` and `ending`: the coroutine's later steps; the last one finishes the
  record (`finish`, nested; it counts the requests, those the native front took too, whose
  `finish` runs in the native return);
- `native return`: the native leg handing streams back (`NativeRelay._hand_back`), with the
  response's head parsed in Python and the cycle's completion: on its own wake-up, or taken
  as a client's bytes are read or on a live pass (a quiet ending, native.py), and then not
  counted in `intake` or the pass as well (a top-level segment run inside another is counted
  in itself alone);
- `upstream reads in Python`: reads of streams the native leg does not hold;
- each periodic duty: the live registry's pass, the live snapshot, the record writer's
  batches, the diagnosis round, the engine scrape;
- `garbage collector`: the cyclic collector's passes on the loop's thread (`gc.callbacks`;
  a pass inside a wrapped call is counted there as well);
- `rest`: the loop thread's CPU over the window (from /proc) less all of the above but the
  collector: the event loop itself (epoll, timers, task scheduling), what runs between the
  wrapped calls.

It starts the fast upstream and phasewatch as `proxy_overhead.py` does, with a
`sitecustomize` on phasewatch's path that installs the wrappers as the app is imported,
counts from the window's start (SIGUSR1) and writes the sums at its end (SIGUSR2). The
wrappers cost two clock reads each (`clock read` below: a system call, since a thread's CPU
clock has no vDSO path); their cost lands in the segments and in the loop's total alike.
One window is a few hundred requests; on a shared VM repeat it (`--repeats`) and read the
medians, as for every CPU figure here.

With the native front on (the default), a kept-alive connection's requests after its first
take none of the request's own steps but the `finish` in the native return: `--no-front`
measures every request on the Python path.

Run: `.venv/bin/python benchmarks/loop_segments.py [--concurrency 256] [--repeats 3]`
(`--source DIR` measures another checkout, e.g. a git worktree of the commit before).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proxy_overhead import HERE, REPO, source_env, start_phasewatch, start_upstream, stop

# Installed into phasewatch's process. The wrappers go in as phasewatch.main is imported
# and count from SIGUSR1; SIGUSR2 writes them
# ("name<TAB>ns<TAB>calls") with the loop thread's CPU over the window, and stops counting.
_PATCHER = '''
import os, signal, sys, time
_out = os.environ.get("PHASEWATCH_LOOP_SEGMENTS")
if _out:
    from time import thread_time_ns
    _sums = {}
    _on = [False, 0]

    def _add(name, ns):
        if _on[0]:
            entry = _sums.setdefault(name, [0, 0])
            entry[0] += ns
            entry[1] += 1

    # The CPU of top-level segments run inside the running one (a quiet ending taken as a
    # client's bytes are read): counted there, and not in the one around it as well.
    _inner = []

    def _top(name, ns):
        inner = _inner.pop()
        _add(name, ns - inner)
        if _inner:
            _inner[-1] += ns

    def _sync(name, fn):
        if name.startswith(" "):  # nested: counted in its segment as well
            def wrapped(*args, **kwargs):
                start = thread_time_ns()
                try:
                    return fn(*args, **kwargs)
                finally:
                    _add(name, thread_time_ns() - start)
        else:
            def wrapped(*args, **kwargs):
                _inner.append(0)
                start = thread_time_ns()
                try:
                    return fn(*args, **kwargs)
                finally:
                    _top(name, thread_time_ns() - start)
        wrapped.__wrapped__ = fn
        return wrapped

    class _Steps:
        """Drives a coroutine, timing each step; `steps`: name the first, middle, last."""

        def __init__(self, name, coro, steps):
            self.name, self.coro, self.steps = name, coro, steps

        def __await__(self):
            coro, value, error, step = self.coro, None, None, 0
            while True:
                _inner.append(0)
                start = thread_time_ns()
                try:
                    out = coro.throw(error) if error is not None else coro.send(value)
                except StopIteration as stop:
                    self._count(step, thread_time_ns() - start, True)
                    return stop.value
                except BaseException:
                    self._count(step, thread_time_ns() - start, True)
                    raise
                self._count(step, thread_time_ns() - start, False)
                step += 1
                try:
                    value, error = (yield out), None
                except BaseException as exc:
                    value, error = None, exc

        def _count(self, step, ns, last):
            if not self.steps:
                _top(self.name, ns)
            elif step == 0:
                _top(self.name[0], ns)
            elif last:
                _top(self.name[2], ns)
            else:
                _top(self.name[1], ns)

    def _async(name, fn, steps=False):
        async def wrapped(*args, **kwargs):  # a coroutine still: create_task() takes it too
            return await _Steps(name, fn(*args, **kwargs), steps)
        wrapped.__wrapped__ = fn
        return wrapped

    def _install():
        import phasewatch.main as main
        from phasewatch.proxy import client_leg, front, native, relay, upstream_pool, live
        from phasewatch.store import live_publisher, writer
        from phasewatch.diagnosis import service
        from phasewatch.engine import scraper
        plain = {  # the top-level segments, then the calls nested in them (indented)
            (client_leg.PhasewatchHttpProtocol, "data_received"): "intake",
            (native.NativeRelay, "_hand_back"): "native return",
            (upstream_pool.UpstreamConnection, "data_received"): "upstream reads in Python",
            (live.LiveStreams, "check"): "duty: live pass",
            (relay, "read_body"): "  read_body",
            (relay, "plan_request"): "  plan_request",
            (relay, "RequestRecord"): "  RequestRecord",
            (upstream_pool.UpstreamPool, "request"): "  the upstream request's bytes",
            (upstream_pool.UpstreamConnection, "send"): "  the upstream request's write",
            (relay.Exchange, "_start_native_at_head"): "  the native leg's start",
            (relay, "finish"): "  finish",
            (front, "finish"): "  finish",  # a native front's request, at its end
            (front.Front, "catch_up"): "  the front's catch-up",
        }
        coroutines = {
            (live.LiveStreams, "refresh"): "duty: live pass",
            (live_publisher.LivePublisher, "publish"): "duty: live snapshot",
            (writer.RecordWriter, "_write"): "duty: record writer",
            (service.DiagnosisService, "evaluate_all"): "duty: diagnosis round",
            (scraper.EngineScraper, "scrape"): "duty: engine scrape",
        }
        for (owner, attr), name in plain.items():
            setattr(owner, attr, _sync(name, getattr(owner, attr)))
        for (owner, attr), name in coroutines.items():
            setattr(owner, attr, _async(name, getattr(owner, attr)))
        main.relay = _async(("request out", "relay, middle steps", "ending"), main.relay, True)

    def _loop_cpu_ns():
        with open(f"/proc/self/task/{os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")

    class _AfterMain:
        """Installs the wrappers as soon as phasewatch.main has run (it imports the rest):
        before any connection, stream or task exists, since the event loop keeps the bound
        methods it was given (a protocol's `data_received`, a reader's callback)."""

        def find_spec(self, name, path, target=None):
            if name != "phasewatch.main":
                return None
            sys.meta_path.remove(self)
            import importlib.util
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _install()

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterMain())

    import gc, threading
    _gc_started = [0]
    _loop_thread = threading.get_ident()  # sitecustomize runs on the thread that serves

    def _gc(phase, info):
        if threading.get_ident() != _loop_thread:
            return
        if phase == "start":
            _gc_started[0] = thread_time_ns()
        else:
            _add("garbage collector", thread_time_ns() - _gc_started[0])

    gc.callbacks.append(_gc)

    def _start(*_):
        _sums.clear()
        _on[0], _on[1] = True, _loop_cpu_ns()
        start = thread_time_ns()
        for _ in range(1000):
            thread_time_ns()
        _sums["clock read"] = [(thread_time_ns() - start) // 1000, 1]

    def _dump(*_):
        _on[0] = False
        with open(_out + ".part", "w") as f:
            f.write(f"loop\\t{_loop_cpu_ns() - _on[1]}\\t1\\n")
            for name, (ns, calls) in _sums.items():
                f.write(f"{name}\\t{ns}\\t{calls}\\n")
        os.replace(_out + ".part", _out)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _dump)
'''

TOP = ("intake", "request out", "relay, middle steps", "ending", "native return",
       "upstream reads in Python", "duty: live pass", "duty: live snapshot",
       "duty: record writer", "duty: diagnosis round", "duty: engine scrape",
       "garbage collector")
NESTED = {"request out": ("  read_body", "  plan_request", "  RequestRecord",
                          "  the upstream request's bytes", "  the upstream request's write",
                          "  the native leg's start"),
          "ending": ("  finish",),
          "duty: live pass": ("  the front's catch-up",)}


def one_window(args: argparse.Namespace, tmp: Path) -> dict[str, tuple[int, int]]:
    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_PATCHER)
    out = tmp / "segments.tsv"
    out.unlink(missing_ok=True)
    paths = [str(hook)]
    if args.source is not None:
        paths.append(source_env(args.source, tmp)["PYTHONPATH"])
    env = {"PYTHONPATH": os.pathsep.join(paths), "PHASEWATCH_LOOP_SEGMENTS": str(out)}
    if args.no_front:  # every request through uvicorn and the relay's coroutine
        env["PHASEWATCH_NATIVE_FRONT"] = "false"
    interval_ms = args.interval_ms = args.concurrency / args.chunk_rate * 1000
    stream_s = args.first_delay_ms / 1000 + args.chunks * interval_ms / 1000
    rate = args.concurrency / stream_s
    upstream = start_upstream(args, tmp)
    proxy = None
    try:
        proxy = start_phasewatch(upstream, tmp, extra_env=env)
        warmup = max(args.warmup, stream_s)
        load = subprocess.Popen([
            sys.executable, str(HERE / "loadgen.py"), "--url", proxy.url,
            "--endpoint", args.endpoint, "--client-usage", args.client_usage,
            "--tokens", str(args.chunks), "--interval-ms", str(interval_ms),
            "--rate", str(rate), "--duration", str(warmup + args.window + 1),
            "--out", str(tmp / "load.json"),
        ], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(warmup + 1.5)
        os.kill(proxy.proc.pid, signal.SIGUSR1)
        time.sleep(args.window)
        os.kill(proxy.proc.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        load.wait(timeout=stream_s * 3 + 30)
    finally:
        if proxy is not None:
            stop(proxy)
        stop(upstream)
    if not out.exists():
        raise RuntimeError("phasewatch wrote no segments (see its log)")
    rows = {}
    for line in out.read_text().splitlines():
        name, ns, calls = line.split("\t")
        rows[name] = (int(ns), int(calls))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=None,
                   help="measure another checkout's app/ (e.g. a worktree of the commit before)")
    p.add_argument("--concurrency", type=int, default=256, help="concurrent streams")
    p.add_argument("--chunk-rate", type=float, default=3200.0,
                   help="chunks per second (proxy_overhead.py's equal rate)")
    p.add_argument("--chunks", type=int, default=64, help="content chunks per stream")
    p.add_argument("--first-delay-ms", type=float, default=0.0)
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds of load before the window (at least a stream's life)")
    p.add_argument("--window", type=float, default=20.0, help="seconds measured")
    p.add_argument("--repeats", type=int, default=1, help="windows, each on fresh servers")
    p.add_argument("--no-front", action="store_true",
                   help="the native front off: every request takes the Python path's steps")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--client-usage", choices=["none", "final", "continuous"], default="none")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = p.parse_args()
    if args.quick:
        args.concurrency, args.chunks, args.warmup, args.window = 16, 8, 1.0, 2.0
        args.chunk_rate, args.repeats = 200.0, 1

    per_request: dict[str, list[float]] = {}
    requests: list[int] = []
    clock_ns: list[int] = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="pw-segments-") as tmp_name:
            rows = one_window(args, Path(tmp_name))
        ended = rows.get("  finish", (0, 0))[1]
        if not ended:
            raise RuntimeError("no request ended in the window")
        requests.append(ended)
        clock_ns.append(rows.pop("clock read")[0])
        loop_ns = rows["loop"][0]
        accounted = sum(rows.get(name, (0, 0))[0] for name in TOP
                        if name != "garbage collector")
        rows["rest"] = (loop_ns - accounted, 1)
        for name, (ns, _) in rows.items():
            per_request.setdefault(name, []).append(ns / ended / 1000)

    def us(name: str) -> float:
        return statistics.median(per_request.get(name, [0.0]))

    shape = (f"{args.concurrency} streams, {args.chunks} chunks each at "
             f"{args.chunk_rate:,.0f} chunks/s, client usage {args.client_usage}")
    print(f"phasewatch's event loop, CPU per request by segment ({shape})")
    print(f"  {args.repeats} window(s) of {args.window:g} s, {statistics.median(requests):.0f} "
          f"requests each (median); figures are medians of the windows, in us per request")
    loop = us("loop")
    print(f"  {'loop thread, in all':<36} {loop:8.1f}   per chunk {loop / args.chunks:.2f} us")
    for name in (*TOP, "rest"):
        if name not in per_request:
            continue
        print(f"  {name:<36} {us(name):8.1f}   {us(name) / loop:6.1%}")
        for inner in NESTED.get(name, ()):
            if inner in per_request:
                print(f"  {inner:<36} {us(inner):8.1f}")
    print(f"  a clock read costs {statistics.median(clock_ns) / 1000:.2f} us; each wrapped call "
          "makes two")
    if args.json is not None:
        args.json.write_text(json.dumps({"shape": shape, "requests": requests,
                                         "us_per_request": per_request}, indent=1))


if __name__ == "__main__":
    main()
