"""Proxy overhead benchmark: what phasewatch adds to a stream, against direct and nginx.

It starts three processes on loopback: a fast fake vLLM (`fast_upstream.py`, OpenAI-format SSE, one
chunk every `--interval-ms`), phasewatch exactly as users run it (`python -m phasewatch.cli serve`,
uvloop + httptools, `PHASEWATCH_LOG_LEVEL=warning`) and nginx (`proxy_buffering off`, HTTP/1.1
upstream keepalive, one process; skipped with a note if nginx is not installed). Then, for each
concurrency level and repeat, it runs the same open-loop Poisson schedule (`loadgen.py`, rate =
concurrency / stream duration, so the steady state holds that many streams) against each path:
direct to the upstream, through phasewatch, through nginx. The order of paths rotates between
repeats so a slow drift of the machine does not always land on the same path.

What it reports, per concurrency (medians over repeats; the machine is small and shared):
- TTFT p50/p99 (send -> first content chunk) and chunk lag p50/p99 (upstream write stamp ->
  client read, on the one CLOCK_MONOTONIC of the host) for each path;
- added TTFT and added lag: percentile through the proxy minus the same percentile direct,
  taken per repeat against the direct run of that repeat, then the median over repeats. A
  difference of percentiles, not a percentile of per-request differences (requests are not
  paired across runs); the lag is measured from the upstream's own stamp, so upstream pacing
  jitter appears in both terms and cancels;
- proxy CPU per relayed chunk: the proxy process's user+sys time from /proc/PID/stat over the
  run, divided by the content chunks the clients received in that run (every request, warm-up
  included). Per-request work (parsing the request, opening the upstream exchange, finishing the
  record) is amortised over the chunks of a stream, and the closing usage/[DONE] events are not
  counted as chunks: the figure is an upper bound on the cost per token chunk;
- phasewatch's CPU per chunk split by thread (/proc/PID/task): the event loop (each process's
  main thread: requests, the response's first reads, records, metrics, the periodic duties'
  own Python), the native relay (the thread relaying the middle of streams, named
  `pw-native-relay`), and other threads (the diagnosis's statistics, the database drivers).
  nginx's whole process is the yardstick for the native relay's share;
- the same CPU per chunk over the arrivals after the warm-up alone (`steady_window`: /proc read
  when the warm-up ends and when the arrivals end, over the content chunks the clients received
  in between), every stream of the shape open. The figure above spreads the whole run's CPU
  over its chunks, the fill-up and the drain included (at 1,024 streams of 20 s, 40 s of an
  80 s run at about half the chunk rate). The targets are checked on the whole run's
  figure;
- the upstream's and load generator's CPU, the generator's lateness against its schedule, and
  the CPU that other processes used on the machine during each run, so noise is visible.

Upstream, proxy and load generator all share the machine's cores: the figures are for this
machine under that contention, not for a proxy with cores to itself.

Each phasewatch starts on an empty database, as a fresh install does, so the diagnosis
schedule's reads are as cheap as they ever are. `--stored-rate R` stores first what an hour at
R requests/s leaves in the span a round reads (`store_history`): the CPU per chunk of a
phasewatch that has been serving that rate, its periodic duties at their steady cost.

Run: `.venv/bin/python benchmarks/proxy_overhead.py [--concurrency 64 256] [--repeats 3]`;
`--quick` is a smoke run of well under a minute. It installs nothing and writes only its JSON
result (`--json`, by default under benchmarks/results/, which git ignores) and temp files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PATHS = ("direct", "phasewatch", "nginx")
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The nginx the scripts compare with unless told another: the one on PATH, else Debian's.
DEFAULT_NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
# The roles of a phasewatch process's threads in the CPU split (`Server.thread_ticks`); the
# native relay's thread carries this name (app/phasewatch/proxy/_native.c).
THREAD_ROLES = ("event loop", "native relay", "other threads")
NATIVE_THREAD_NAME = "pw-native-relay"

# Targets, all relative to nginx measured in the same run: CPU per relayed chunk within 1.5x
# of nginx's at every shape (goal 1.2x); at 256 streams, added TTFT p99 at most nginx's + 2 ms
# and added chunk lag p99 at most nginx's + 1 ms.
TARGET_CPU_RATIO = 1.5
GOAL_CPU_RATIO = 1.2
TARGET_CONCURRENCY = 256
TARGET_TTFT_P99_OVER_NGINX_MS = 2.0
TARGET_LAG_P99_OVER_NGINX_MS = 1.0
# Capacity: the chunk rate a path relays while its chunk-lag p99 stays under this.
CAPACITY_LAG_P99_MS = 10.0


# ---------------------------------------------------------------------------------------------
# Processes


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_ticks(self) -> tuple[int, int] | None:
        """User and system CPU of the process and its children (all their threads: the
        workers of `serve --workers N`), in clock ticks."""
        total = proc_cpu_ticks(self.proc.pid)
        if total is None:
            return None
        for child in child_pids(self.proc.pid):
            ticks = proc_cpu_ticks(child)
            if ticks is not None:
                total = (total[0] + ticks[0], total[1] + ticks[1])
        return total

    def thread_ticks(self) -> dict[str, int]:
        """CPU ticks (user+sys) of the event loops (each process's main thread: a worker's
        event loop; under `--workers`, the supervisor's and its helper processes' too, which
        idle) and of the native relays' threads (named by `_native.c`), summed over the
        process and its children. The rest of `cpu_ticks` is other threads' (those that have
        exited too)."""
        out = {"event loop": 0, "native relay": 0}
        for pid in (self.proc.pid, *child_pids(self.proc.pid)):
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                except OSError:
                    continue
                name, _, rest = stat.partition("(")[2].rpartition(")")
                role = ("event loop" if tid == str(pid) else
                        "native relay" if name == NATIVE_THREAD_NAME else None)
                if role is not None:
                    fields = rest.split()
                    out[role] += int(fields[11]) + int(fields[12])
        return out

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def proc_cpu_ticks(pid: int) -> tuple[int, int] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces
    return int(fields[11]), int(fields[12])  # utime, stime: fields 14 and 15 of stat


def child_pids(pid: int) -> list[int]:
    """Every descendant of `pid` alive now."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def system_busy_ticks() -> tuple[int, int] | None:
    """Busy CPU ticks of the whole machine (all cores), and of those the (soft)irq ticks.

    Loopback networking runs largely in softirq context, which Linux charges to the machine
    but not to the process that caused it: it is reported apart from other processes' load.
    """
    try:
        line = Path("/proc/stat").read_text().splitlines()[0]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, line.split()[1:9])
    return user + nice + system + irq + softirq + steal, irq + softirq


def calibrate() -> dict[str, float]:
    """CPU microseconds of two reference operations, to compare this machine with others.

    docs' performance facts were measured where perf_counter_ns cost 0.05 us and orjson.loads
    of a small chunk 0.5 us; a shared or throttled machine can be several times slower.
    """
    import orjson

    chunk = (b'{"id":"cmpl-1-1","object":"text_completion","created":1,"model":"bench",'
             b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null,'
             b'"stop_reason":null}],"usage":{"prompt_tokens":16,"total_tokens":17,'
             b'"completion_tokens":1}}')
    out: dict[str, float] = {}
    for name, fn, n in (("perf_counter_ns_us", time.perf_counter_ns, 200_000),
                        ("orjson_loads_chunk_us", lambda: orjson.loads(chunk), 100_000)):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        out[name] = (time.process_time() - t0) / n * 1e6
    return out


def raise_fd_limit() -> None:
    """Open-file limit up to the hard limit: children inherit it, room for every socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY
                                                    else 65536, hard))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(server: Server, path: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(server.url + path, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"{server.name} did not become ready on {server.url}{path}:\n"
                       f"{server.log_tail()}")


def spawn(name: str, cmd: Sequence[str], tmp: Path, port: int,
          env: dict[str, str] | None = None) -> Server:
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    return Server(name, proc, port, log)


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def start_upstream(args: argparse.Namespace, tmp: Path) -> Server:
    port = free_port()
    server = spawn("upstream", [
        sys.executable, str(HERE / "fast_upstream.py"), "--port", str(port),
        "--interval-ms", str(args.interval_ms), "--first-delay-ms", str(args.first_delay_ms),
        "--tokens", str(args.chunks),
    ], tmp, port)
    wait_ready(server, "/health")
    return server


def start_phasewatch(upstream: Server, tmp: Path, workers: int = 1, name: str | None = None,
                     extra_env: dict[str, str] | None = None, stored_rate: float = 0,
                     python: str = sys.executable) -> Server:
    port = free_port()
    name = name or ("phasewatch" if workers == 1 else f"phasewatch-w{workers}")
    database_url = f"sqlite+aiosqlite:///{tmp / (name + '.db')}"
    if stored_rate > 0:
        store_history(database_url, stored_rate)
    env = {**os.environ, "PHASEWATCH_LOG_LEVEL": "warning", "PHASEWATCH_ADMIN_OPEN": "true",
           "PHASEWATCH_DATABASE_URL": database_url, **(extra_env or {})}
    server = spawn(name, [
        python, "-m", "phasewatch.cli", "serve", "--upstream", upstream.url,
        "--port", str(port),
        "--workers", str(workers),
    ], tmp, port, env)
    wait_ready(server, "/api/health")
    return server


def store_history(database_url: str, rate: float) -> int:
    """Fill a new database with what `rate` requests a second of the benchmark's model leave
    in the span a diagnosis round reads (window + baseline, by default 3,900 s up to now),
    through the record writer's own insert: the schedule then reads what it would read after
    an hour at that rate, not the empty tables of a fresh install. Returns the rows stored."""
    import asyncio
    from datetime import UTC, datetime, timedelta

    from phasewatch.core.db import create_engine
    from phasewatch.core.records import Outcome, RequestRecord
    from phasewatch.core.settings import Settings
    from phasewatch.store.migrate import upgrade
    from phasewatch.store.writer import insert_rows, record_row

    defaults = Settings()
    span_s = defaults.diagnosis_window_s + defaults.diagnosis_baseline_s
    total = int(rate * span_s)
    end = datetime.now(UTC)
    upgrade(database_url)

    def record(i: int) -> RequestRecord:
        ttft, itl = 0.002 + 0.001 * (i % 7), 0.02 + 0.0001 * (i % 11)
        return RequestRecord(
            request_id=f"history-{i}", started_at=end - timedelta(seconds=span_s * (1 - i / total)),
            endpoint="completions", model="bench", upstream="http://upstream", stream=True,
            outcome=Outcome.OK, http_status=200, in_flight_at_arrival=i % 64, ttft_s=ttft,
            e2e_s=ttft + 63 * itl, tpot_s=itl, itl_count=63, itl_mean_s=itl, itl_p50_s=itl,
            itl_p95_s=itl * 1.1, itl_max_s=itl * 1.5, prompt_tokens=16, output_tokens=64,
            tokens_exact=True)

    async def load() -> None:
        engine = create_engine(database_url)
        try:
            for start in range(0, total, 20_000):
                rows = [record_row(record(i)) for i in range(start, min(total, start + 20_000))]
                async with engine.begin() as connection:
                    await insert_rows(connection, rows)
        finally:
            await engine.dispose()

    asyncio.run(load())
    return total


def source_env(source: Path, tmp: Path) -> dict[str, str]:
    """Run phasewatch from another checkout (`source`, e.g. a git worktree of the previous
    commit), ahead of this checkout's editable install: its app/ is the source root (an older
    checkout's app/ is the package itself, reached through a link under the import name)."""
    if (source / "app" / "phasewatch" / "__init__.py").is_file():
        return {"PYTHONPATH": str(source.resolve() / "app")}
    if not (source / "app" / "__init__.py").is_file():
        raise SystemExit(f"--baseline-source {source}: no phasewatch package under app/ there")
    shim = tmp / "baseline-source"
    shim.mkdir()
    (shim / "phasewatch").symlink_to(source.resolve() / "app")
    return {"PYTHONPATH": str(shim)}


def parse_interpreters(specs: Sequence[str]) -> list[tuple[str, str]]:
    """`--interpreter NAME:PYTHON` -> [("pw@NAME", PYTHON)], each with this checkout installed
    (editable, so its `app/` and native leg are the ones measured)."""
    interpreters = []
    for spec in specs:
        name, _, python = spec.partition(":")
        if not name or not python:
            raise SystemExit(f"--interpreter {spec!r}: expected NAME:PATH")
        probe = subprocess.run(
            [python, "-c", "import phasewatch.proxy._native, phasewatch; "
                           "print(phasewatch.__file__)"],
            capture_output=True, text=True, cwd="/")
        if probe.returncode != 0 or not probe.stdout.strip().startswith(str(REPO / "app")):
            raise SystemExit(
                f"--interpreter {spec!r}: it does not import this checkout's phasewatch with "
                f"its native leg ({(probe.stderr or probe.stdout).strip()[-200:]}); install it "
                "there with `PYTHON -m pip install -r requirements.lock` and `PYTHON -m pip "
                "install --no-deps -e .`")
        interpreters.append((f"pw@{name}", python))
    return interpreters


def parse_variants(specs: Sequence[str]) -> list[tuple[str, dict[str, str]]]:
    """`--variant NAME:KEY=VALUE[,KEY=VALUE]` -> [("pw:NAME", {KEY: VALUE})]."""
    variants = []
    for spec in specs:
        name, _, assignments = spec.partition(":")
        env = dict(item.split("=", 1) for item in assignments.split(",") if "=" in item)
        if not name or not env or not all(key.startswith("PHASEWATCH_") for key in env):
            raise SystemExit(f"--variant {spec!r}: expected NAME:PHASEWATCH_KEY=VALUE[,...]")
        variants.append((f"pw:{name}", env))
    return variants


class OtlpSink:
    """Where the `pw+otel` path exports: accepts every OTLP/HTTP request and answers 200 with
    an empty body (what a collector's success looks like to the exporter); counts the bytes."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        sink = self
        self.requests = self.bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                sink.bytes += len(self.rfile.read(int(self.headers.get("content-length", 0))))
                sink.requests += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def nginx_version(nginx: str) -> str:
    out = subprocess.run([nginx, "-v"], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).strip().removeprefix("nginx version: ")


def nginx_config(tmp: Path, port: int, upstream_port: int, nginx: str) -> str:
    built = subprocess.run([nginx, "-V"], capture_output=True, text=True, check=False).stderr
    # Point every temp path nginx was built with into our directory (not /var/lib/nginx).
    temp_paths = "\n".join(
        f"    {kind}_temp_path {tmp / ('nginx-' + kind)};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        if kind == "client_body" or f"--http-{kind}-temp-path" in built
    )
    return f"""
daemon off;
master_process off;  # one process: its CPU is the proxy's CPU
worker_processes 1;
pid {tmp / 'nginx.pid'};
error_log {tmp / 'nginx-error.log'} warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
{temp_paths}
    keepalive_requests 1000000;
    upstream fast {{
        server 127.0.0.1:{upstream_port};
        keepalive 1024;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://fast;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def start_nginx(nginx: str, upstream: Server, tmp: Path) -> Server:
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(nginx_config(tmp, port, upstream.port, nginx))
    server = spawn("nginx", [
        nginx, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "nginx-error.log"),
    ], tmp, port)
    wait_ready(server, "/health")
    return server


# ---------------------------------------------------------------------------------------------
# One run: one schedule against one path


@dataclass
class Run:
    path: str
    concurrency: int
    repeat: int
    rate: float
    scheduled: int
    ok: int
    measured: int
    errors: dict[str, int]
    content_chunks: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    wall_s: float
    proxy_cpu_us_per_chunk: float | None  # None for the direct path
    proxy_sys_us_per_chunk: float | None  # the kernel's share of it (socket reads and writes)
    # phasewatch's CPU per chunk by thread role (THREAD_ROLES); empty for the other paths
    proxy_threads_us_per_chunk: dict[str, float | None]
    upstream_cpu_us_per_chunk: float | None
    # The same over the arrivals after the warm-up alone, every stream of the shape open (the
    # fill-up and the drain left out): a deployment's steady state (`steady_window`).
    steady_cpu_us_per_chunk: float | None
    steady_threads_us_per_chunk: dict[str, float | None]
    loadgen_busy_cores: float  # the generator's CPU over its active window / that window
    loadgen_lateness_p99_ms: float | None
    other_load_cores: float | None  # CPU used by processes outside this benchmark
    irq_cores: float | None  # kernel (soft)irq time: mostly loopback networking, ours included
    max_in_flight: int
    extra: dict[str, Any] = field(default_factory=dict)


def percentile_ms(samples: list[int], q: float) -> float | None:
    """Nearest-rank percentile of nanosecond samples, in milliseconds."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))
    return ordered[rank] / 1e6


def cpu_between(start: tuple[int, int] | None, start_threads: dict[str, int],
                end: tuple[int, int] | None, end_threads: dict[str, int],
                ) -> dict[str, float] | None:
    """CPU seconds between two reads of `Server.cpu_ticks` and `Server.thread_ticks`: `total`,
    `sys`, one per thread role, and `other threads` (the total less the roles)."""
    if start is None or end is None:
        return None
    total = (end[0] + end[1] - start[0] - start[1]) / CLK_TCK
    out = {"total": total, "sys": (end[1] - start[1]) / CLK_TCK}
    for role, ticks in end_threads.items():
        out[role] = (ticks - start_threads.get(role, 0)) / CLK_TCK
        total -= out[role]
    out["other threads"] = total
    return out


@contextmanager
def cpu_window(servers: Sequence[Server]) -> Iterator[dict[str, float | None]]:
    """CPU seconds used by each server, waited children, and the whole machine in the block."""
    out: dict[str, float | None] = {}
    before = {s.name: s.cpu_ticks() for s in servers}
    threads_before = {s.name: s.thread_ticks() for s in servers}
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0 = system_busy_ticks()
    yield out
    busy1 = system_busy_ticks()
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    for s in servers:
        used = cpu_between(before[s.name], threads_before[s.name], s.cpu_ticks(),
                           s.thread_ticks())
        if used is None:
            out[s.name] = out[s.name + ".sys"] = None
            continue
        out[s.name] = used.pop("total")
        out.update({f"{s.name}.{key}": value for key, value in used.items()})
    out["children"] = (children1.ru_utime - children0.ru_utime) + (
        children1.ru_stime - children0.ru_stime)
    if busy0 is not None and busy1 is not None:
        out["machine"] = (busy1[0] - busy0[0]) / CLK_TCK
        out["irq"] = (busy1[1] - busy0[1]) / CLK_TCK
    else:
        out["machine"] = out["irq"] = None


# Seconds of arrivals a run has at least, by default: enough requests after the fill-up (about
# 2,500 at 256 streams) that TTFT p99 does not rest on the two or three slowest, and the
# diagnosis's window holds a minute of records, as in a deployment's steady state.
MIN_DURATION_S = 60.0


@dataclass(frozen=True)
class Shape:
    """One load shape: `concurrency` streams held open, each `chunks` chunks `interval_ms`
    apart. With `--chunk-rate`, the interval grows with concurrency so that every shape
    relays the same chunks per second (64 x 20 ms, 256 x 80 ms, 1,024 x 320 ms at 3,200/s):
    what changes between shapes is the number of open streams, not the work per second."""

    concurrency: int
    interval_ms: float
    stream_s: float  # first delay + chunks x interval: one stream's life
    rate: float  # arrivals per second that hold `concurrency` streams open
    duration: float  # seconds of arrivals per run
    warmup: float  # arrivals before this are run but not measured (the fill-up)


def make_shape(args: argparse.Namespace, concurrency: int) -> Shape:
    interval = (concurrency / args.chunk_rate * 1000 if args.chunk_rate else args.interval_ms)
    stream_s = args.first_delay_ms / 1000 + args.chunks * interval / 1000
    # Long streams need a run long enough to fill up to the steady state and hold it, and every
    # shape enough measured requests for its p99 (`MIN_DURATION_S`).
    duration = (args.duration if args.duration is not None
                else max(MIN_DURATION_S, 2 * stream_s))
    warmup = args.warmup if args.warmup is not None else min(max(2.0, stream_s), duration / 2)
    return Shape(concurrency, interval, stream_s, concurrency / stream_s, duration, warmup)


def run_loadgen(args: argparse.Namespace, target: Server, shape: Shape, seed: int,
                tmp: Path, start_at: int | None = None) -> dict[str, Any]:
    """Run the schedule with `--loadgen-procs` shards starting together (at `start_at`, a
    CLOCK_MONOTONIC time in ns; by default 1.5 s from now); merge their samples."""
    if start_at is None:
        start_at = time.monotonic_ns() + 1_500_000_000  # for the shards to import and connect
    drain = shape.stream_s * 3 + 10
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    for shard in range(args.loadgen_procs):
        out = tmp / f"loadgen-{shard}.json"
        out.unlink(missing_ok=True)
        cmd = [
            sys.executable, str(HERE / "loadgen.py"), "--url", target.url,
            "--endpoint", args.endpoint, "--client-usage", args.client_usage,
            "--tokens", str(args.chunks), "--rate", str(shape.rate),
            "--duration", str(shape.duration), "--warmup", str(shape.warmup),
            "--interval-ms", str(shape.interval_ms), "--seed", str(seed), "--shard", str(shard),
            "--shards", str(args.loadgen_procs), "--start-at-ns", str(start_at),
            "--drain-timeout", str(drain), "--out", str(out),
        ]
        procs.append((subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL), out))
    merged: dict[str, Any] = {
        "ttft_ns": [], "lag_ns": [], "lateness_ns": [], "errors": {}, "scheduled": 0,
        "measured": 0, "ok": 0, "content_chunks": 0, "events": 0, "max_in_flight": 0,
        "cpu_s": 0.0, "wall_s": 0.0,
    }
    for proc, out in procs:
        if proc.wait() != 0 or not out.exists():
            raise RuntimeError(
                f"load generator failed against {target.name} (exit {proc.returncode})")
        shard = json.loads(out.read_text())
        for key in ("ttft_ns", "lag_ns", "lateness_ns"):
            merged[key].extend(shard[key])
        for key in ("scheduled", "measured", "ok", "content_chunks", "events", "max_in_flight",
                    "cpu_s"):
            merged[key] += shard[key]
        merged["wall_s"] = max(merged["wall_s"], shard["wall_s"])
        merged["window_chunks"] = merged.get("window_chunks", 0) + shard["window_chunks"]
        for name, count in shard["errors"].items():
            merged["errors"][name] = merged["errors"].get(name, 0) + count
    return merged


def steady_window(server: Server, start_ns: int, end_ns: int) -> tuple[threading.Thread,
                                                                        dict[str, float]]:
    """CPU seconds `server` used between two CLOCK_MONOTONIC moments (key `total`, and one
    per THREAD_ROLES), read from /proc by a thread that sleeps until each: the arrivals after
    the warm-up, while every stream of the shape is open. Join the thread, then read."""
    out: dict[str, float] = {}

    def run() -> None:
        time.sleep(max(0.0, (start_ns - time.monotonic_ns()) / 1e9))
        first, first_threads = server.cpu_ticks(), server.thread_ticks()
        time.sleep(max(0.0, (end_ns - time.monotonic_ns()) / 1e9))
        out.update(cpu_between(first, first_threads, server.cpu_ticks(),
                               server.thread_ticks()) or {})

    thread = threading.Thread(target=run, name="steady-window", daemon=True)
    thread.start()
    return thread, out


def one_run(args: argparse.Namespace, path: str, target: Server, upstream: Server,
            proxies: dict[str, Server], shape: Shape, repeat: int, tmp: Path) -> Run:
    seed = args.seed * 1000 + repeat  # the same schedule for every path within a repeat
    watched = [upstream, *proxies.values()]
    start_at = time.monotonic_ns() + 1_500_000_000  # as run_loadgen's default
    sampler, steady = steady_window(target, start_at + int(shape.warmup * 1e9),
                                    start_at + int(shape.duration * 1e9))
    with cpu_window(watched) as cpu:
        result = run_loadgen(args, target, shape, seed, tmp, start_at)
    sampler.join()
    chunks = result["content_chunks"]
    window_chunks = result.get("window_chunks", 0)

    def steady_us(cpu_s: float | None) -> float | None:
        return cpu_s / window_chunks * 1e6 if cpu_s is not None and window_chunks else None

    def per_chunk_us(cpu_s: float | None) -> float | None:
        return cpu_s / chunks * 1e6 if cpu_s is not None and chunks else None

    wall = result["wall_s"] or 1.0
    other = irq = None
    window = wall + 1.5  # the whole CPU window, shard start-up included
    concurrency, rate = shape.concurrency, shape.rate
    if cpu["machine"] is not None and all(cpu[s.name] is not None for s in watched):
        ours = sum(cpu[s.name] or 0.0 for s in watched) + (cpu["children"] or 0.0)
        irq_s = cpu["irq"] or 0.0
        other = max(0.0, (cpu["machine"] - ours - irq_s) / window)
        irq = irq_s / window
    return Run(
        path=path, concurrency=concurrency, repeat=repeat, rate=rate,
        scheduled=result["scheduled"], ok=result["ok"], measured=result["measured"],
        errors=result["errors"], content_chunks=chunks,
        ttft_p50_ms=percentile_ms(result["ttft_ns"], 0.50),
        ttft_p99_ms=percentile_ms(result["ttft_ns"], 0.99),
        lag_p50_ms=percentile_ms(result["lag_ns"], 0.50),
        lag_p99_ms=percentile_ms(result["lag_ns"], 0.99),
        wall_s=wall,
        proxy_cpu_us_per_chunk=per_chunk_us(cpu[path]) if path in proxies else None,
        proxy_sys_us_per_chunk=per_chunk_us(cpu[path + ".sys"]) if path in proxies else None,
        proxy_threads_us_per_chunk={
            role: per_chunk_us(cpu.get(f"{path}.{role}")) for role in THREAD_ROLES
        } if path in proxies and path != "nginx" else {},
        upstream_cpu_us_per_chunk=per_chunk_us(cpu[upstream.name]),
        steady_cpu_us_per_chunk=steady_us(steady.get("total")) if path in proxies else None,
        steady_threads_us_per_chunk={
            role: steady_us(steady.get(role)) for role in THREAD_ROLES
        } if path in proxies and path != "nginx" else {},
        loadgen_busy_cores=result["cpu_s"] / wall,
        loadgen_lateness_p99_ms=percentile_ms(result["lateness_ns"], 0.99),
        other_load_cores=other,
        irq_cores=irq,
        max_in_flight=result["max_in_flight"],
    )


# ---------------------------------------------------------------------------------------------
# Summaries


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


METRICS = ("ttft_p50_ms", "ttft_p99_ms", "lag_p50_ms", "lag_p99_ms")


def summarize(runs: list[Run], concurrency: int, paths: Sequence[str]) -> dict[str, Any]:
    """Medians over repeats; `added` is the median of per-repeat (path - direct) differences."""
    by = {(r.path, r.repeat): r for r in runs if r.concurrency == concurrency}
    repeats = sorted({r.repeat for r in runs if r.concurrency == concurrency})
    out: dict[str, Any] = {}
    for path in paths:
        mine = [by[(path, i)] for i in repeats if (path, i) in by]
        entry: dict[str, Any] = {m: median([getattr(r, m) for r in mine]) for m in METRICS}
        entry["proxy_cpu_us_per_chunk"] = median([r.proxy_cpu_us_per_chunk for r in mine])
        entry["proxy_sys_us_per_chunk"] = median([r.proxy_sys_us_per_chunk for r in mine])
        entry["proxy_threads_us_per_chunk"] = {
            role: median([r.proxy_threads_us_per_chunk.get(role) for r in mine])
            for role in THREAD_ROLES
        } if any(r.proxy_threads_us_per_chunk for r in mine) else {}
        entry["upstream_cpu_us_per_chunk"] = median([r.upstream_cpu_us_per_chunk for r in mine])
        entry["steady_cpu_us_per_chunk"] = median([r.steady_cpu_us_per_chunk for r in mine])
        entry["steady_threads_us_per_chunk"] = {
            role: median([r.steady_threads_us_per_chunk.get(role) for r in mine])
            for role in THREAD_ROLES
        } if any(r.steady_threads_us_per_chunk for r in mine) else {}
        entry["loadgen_busy_cores"] = median([r.loadgen_busy_cores for r in mine])
        entry["loadgen_lateness_p99_ms"] = median([r.loadgen_lateness_p99_ms for r in mine])
        entry["other_load_cores"] = median([r.other_load_cores for r in mine])
        entry["irq_cores"] = median([r.irq_cores for r in mine])
        entry["ok"] = sum(r.ok for r in mine)
        entry["scheduled"] = sum(r.scheduled for r in mine)
        entry["errors"] = sum(sum(r.errors.values()) for r in mine)
        entry["measured_per_run"] = median([float(r.measured) for r in mine])
        if path not in ("direct", "nginx"):
            # nginx's own CPU per chunk moves by a third between repeats on a shared VM: each
            # repeat's ratio shows how far the median's can be trusted.
            entry["cpu_vs_nginx_per_repeat"] = [
                a.proxy_cpu_us_per_chunk / b.proxy_cpu_us_per_chunk
                for i in repeats
                if (a := by.get((path, i))) is not None and (b := by.get(("nginx", i))) is not None
                and a.proxy_cpu_us_per_chunk and b.proxy_cpu_us_per_chunk]
            entry["steady_cpu_vs_nginx_per_repeat"] = [
                a.steady_cpu_us_per_chunk / b.steady_cpu_us_per_chunk
                for i in repeats
                if (a := by.get((path, i))) is not None and (b := by.get(("nginx", i))) is not None
                and a.steady_cpu_us_per_chunk and b.steady_cpu_us_per_chunk]
        if path != "direct":
            for m in METRICS:
                diffs: list[float | None] = []
                for i in repeats:
                    a, b = by.get((path, i)), by.get(("direct", i))
                    va = getattr(a, m) if a else None
                    vb = getattr(b, m) if b else None
                    diffs.append(va - vb if va is not None and vb is not None else None)
                entry["added_" + m] = median(diffs)
        out[path] = entry
    return out


def fmt(value: float | None, unit: str = "", sign: bool = False, digits: int = 2) -> str:
    if value is None:
        return "-"
    text = f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"
    return text + unit


def cpu_cell(entry: dict[str, Any]) -> str:
    total, kernel = entry["proxy_cpu_us_per_chunk"], entry["proxy_sys_us_per_chunk"]
    return "-" if total is None else f"{total:.1f} ({fmt(kernel, digits=1)})"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "-"
    return f"{a / b:.1f}x"


def print_level(shape: Shape, summary: dict[str, Any], paths: Sequence[str],
                loadgen_procs: int) -> None:
    print(f"\n== {shape.concurrency} concurrent streams, a chunk every {shape.interval_ms:g} ms "
          f"({shape.rate:.1f} arrivals/s) ==")
    head = f"{'path':<11}{'TTFT p50':>10}{'TTFT p99':>10}{'lag p50':>10}{'lag p99':>10}" \
           f"{'CPU/chunk (sys)':>18}{'ok/sched':>13}{'errors':>8}"
    print(head + "   (ms; CPU: us of the proxy process per content chunk, kernel part)")
    for path in paths:
        e = summary[path]
        print(f"{path:<11}{fmt(e['ttft_p50_ms']):>10}{fmt(e['ttft_p99_ms']):>10}"
              f"{fmt(e['lag_p50_ms']):>10}{fmt(e['lag_p99_ms']):>10}"
              f"{cpu_cell(e):>18}"
              f"{str(e['ok']) + '/' + str(e['scheduled']):>13}{e['errors']:>8}")
    print("added vs direct (per repeat: percentile via proxy - same percentile direct; median):")
    for path in paths:
        if path == "direct":
            continue
        e = summary[path]
        print(f"{path:<11}" + "".join(f"{fmt(e['added_' + m], sign=True):>10}" for m in METRICS))
    d = summary["direct"]
    pw = summary.get("phasewatch", {})
    ng = summary.get("nginx")
    print(f"baseline: upstream CPU {fmt(d['upstream_cpu_us_per_chunk'], ' us', digits=1)}/chunk; "
          f"load generator {fmt(d['loadgen_busy_cores'])} cores busy, "
          f"send lateness p99 {fmt(d['loadgen_lateness_p99_ms'])} ms")
    print(f"machine: other processes used "
          f"{fmt(median([summary[p]['other_load_cores'] for p in paths]))} cores, kernel "
          f"softirq (loopback network) {fmt(median([summary[p]['irq_cores'] for p in paths]))} "
          f"cores (medians over paths and repeats)")
    if ng is not None:
        print(f"phasewatch adds {fmt(pw['added_ttft_p99_ms'], ' ms', True)} TTFT p99 (nginx adds "
              f"{fmt(ng['added_ttft_p99_ms'], ' ms', True)}), "
              f"{fmt(pw['added_lag_p99_ms'], ' ms', True)} chunk lag p99 (nginx "
              f"{fmt(ng['added_lag_p99_ms'], ' ms', True)})")
        print(f"CPU/chunk: phasewatch {fmt(pw['proxy_cpu_us_per_chunk'], ' us', digits=1)} vs "
              f"nginx {fmt(ng['proxy_cpu_us_per_chunk'], ' us', digits=1)} "
              f"({ratio(pw['proxy_cpu_us_per_chunk'], ng['proxy_cpu_us_per_chunk'])}; per "
              f"repeat {', '.join(f'{r:.2f}' for r in pw.get('cpu_vs_nginx_per_repeat', []))}); "
              f"upstream itself {fmt(d['upstream_cpu_us_per_chunk'], ' us', digits=1)}")
        split = pw.get("proxy_threads_us_per_chunk")
        if split:
            print("phasewatch CPU/chunk by thread: " + ", ".join(
                f"{role} {fmt(split[role], ' us', digits=1)}" for role in THREAD_ROLES)
                + f" (nginx's whole process {fmt(ng['proxy_cpu_us_per_chunk'], ' us', digits=1)})")
        steady, steady_split = pw.get("steady_cpu_us_per_chunk"), pw.get(
            "steady_threads_us_per_chunk") or {}
        print(f"CPU/chunk with every stream open (arrivals from {shape.warmup:g} to "
              f"{shape.duration:g} s; fill-up and drain left out): phasewatch "
              f"{fmt(steady, ' us', digits=1)} vs nginx "
              f"{fmt(ng.get('steady_cpu_us_per_chunk'), ' us', digits=1)} "
              f"({ratio(steady, ng.get('steady_cpu_us_per_chunk'))}; per repeat "
              f"{', '.join(f'{r:.2f}' for r in pw.get('steady_cpu_vs_nginx_per_repeat', []))})"
              + ("; by thread " + ", ".join(f"{role} {fmt(steady_split[role], ' us', digits=1)}"
                                             for role in THREAD_ROLES) if steady_split else ""))
    else:
        print(f"phasewatch adds {fmt(pw['added_ttft_p99_ms'], ' ms', True)} TTFT p99, "
              f"{fmt(pw['added_lag_p99_ms'], ' ms', True)} chunk lag p99; CPU/chunk "
              f"{fmt(pw['proxy_cpu_us_per_chunk'], ' us', digits=1)} (nginx not measured)")
    others = [("pw@base", "the baseline checkout"), ("pw+otel", "OpenTelemetry on")]
    others += [(name, "a variant") for name in summary if name.startswith("pw:")]
    others += [(name, "another interpreter") for name in summary
               if name.startswith("pw@") and name != "pw@base"]
    for other, what in others:
        if other in summary and pw:
            o = summary[other]
            mine, theirs = pw["proxy_cpu_us_per_chunk"], o["proxy_cpu_us_per_chunk"]
            share = f"{mine / theirs:.3f}x" if mine and theirs else "-"
            to_nginx = ""
            if ng is not None:
                to_nginx = (f"; {other} to nginx "
                            f"{ratio(theirs, ng['proxy_cpu_us_per_chunk'])} (per repeat "
                            f"{', '.join(f'{r:.2f}' for r in o['cpu_vs_nginx_per_repeat'])})")
            print(f"CPU/chunk: {other} ({what}) {fmt(theirs, ' us', digits=1)} vs phasewatch "
                  f"{fmt(mine, ' us', digits=1)} (phasewatch = {share} of it); added lag p99 "
                  f"{fmt(o['added_lag_p99_ms'], ' ms', True)} vs "
                  f"{fmt(pw['added_lag_p99_ms'], ' ms', True)}{to_nginx}")
    if (d["loadgen_busy_cores"] or 0) > 0.7 * loadgen_procs:
        print("WARNING: the load generator is near a full core; try --loadgen-procs 2")
    elif (d["loadgen_lateness_p99_ms"] or 0) > 5:
        print("WARNING: requests went out late even on the direct path: the machine's cores "
              "are saturated, so these figures include CPU queueing, not only proxy cost")


def check_targets(summaries: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets, each against nginx in the same run; `met` is None where nginx was not run."""
    checks: list[dict[str, Any]] = []
    for concurrency, summary in summaries.items():
        ng = summary.get("nginx")
        pw = summary["phasewatch"]["proxy_cpu_us_per_chunk"]
        value = None
        if ng is not None and pw is not None and ng["proxy_cpu_us_per_chunk"]:
            value = pw / ng["proxy_cpu_us_per_chunk"]
        checks.append({
            "target": f"CPU per chunk <= {TARGET_CPU_RATIO:g}x nginx at {concurrency} streams "
                      f"(goal {GOAL_CPU_RATIO:g}x)",
            "value": value, "met": None if value is None else value <= TARGET_CPU_RATIO})
    at = summaries.get(TARGET_CONCURRENCY)
    for key, limit, label in (
        ("added_ttft_p99_ms", TARGET_TTFT_P99_OVER_NGINX_MS, "added TTFT p99"),
        ("added_lag_p99_ms", TARGET_LAG_P99_OVER_NGINX_MS, "added chunk lag p99"),
    ):
        name = f"{label} <= nginx's + {limit:g} ms at {TARGET_CONCURRENCY} streams"
        value = None
        if at is not None and "nginx" in at:
            pw, ng = at["phasewatch"][key], at["nginx"][key]
            value = pw - ng if pw is not None and ng is not None else None
        checks.append({"target": name, "value": value,
                       "met": None if value is None else value <= limit})
    return checks


# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024],
                   help="target concurrent streams (default: 64 256 1024)")
    p.add_argument("--chunk-rate", type=float, default=3200.0,
                   help="chunks per second every shape relays: the gap between a stream's "
                        "chunks is concurrency / rate (default 3200: 20 ms at 64 streams); "
                        "0 uses --interval-ms for every shape")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (default 3)")
    p.add_argument("--duration", type=float, default=None,
                   help=f"seconds of arrivals per run (default: {MIN_DURATION_S:g}, or twice a "
                        "stream's life if longer)")
    p.add_argument("--warmup", type=float, default=None,
                   help="arrivals in the first seconds of a run are not measured (default: "
                        "a stream's life, at least 2 s: the fill-up to steady state)")
    p.add_argument("--chunks", type=int, default=64, help="content chunks per stream")
    p.add_argument("--interval-ms", type=float, default=20.0,
                   help="time between chunks when --chunk-rate is 0 (default 20)")
    p.add_argument("--first-delay-ms", type=float, default=0.0,
                   help="upstream delay before the first chunk (prefill stand-in)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--client-usage", choices=["none", "final", "continuous"], default="none",
                   help="stream_options the clients send (none: phasewatch adds usage "
                        "upstream and strips it, its most expensive path)")
    p.add_argument("--loadgen-procs", type=int, default=1, help="load generator processes")
    p.add_argument("--nginx", default=DEFAULT_NGINX,
                   help="nginx binary (the column is skipped if it is missing)")
    p.add_argument("--workers", type=int, nargs="+", default=[1],
                   help="also run phasewatch with each of these --workers counts (default 1: "
                        "one process only); e.g. --workers 1 2")
    p.add_argument("--baseline-source", type=Path, default=None,
                   help="also run phasewatch from this other checkout (path `pw@base`), e.g. a "
                        "git worktree of the commit before a change, to compare CPU per chunk "
                        "in the same run")
    p.add_argument("--otel", action="store_true",
                   help="also run phasewatch with OpenTelemetry on (path `pw+otel`), exporting "
                        "to a sink on loopback (needs the otel extra)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,...]",
                   help="also run phasewatch with these settings (path `pw:NAME`), e.g. "
                        "nodiag:PHASEWATCH_DIAGNOSIS_INTERVAL_S=0 to see what a periodic duty "
                        "costs; repeatable")
    p.add_argument("--interpreter", action="append", default=[], metavar="NAME:PYTHON",
                   help="also run phasewatch, this checkout's code, under another Python (path "
                        "`pw@NAME`), e.g. an optimized build (PGO, LTO) like the container "
                        "image's: a CPython 3.11 with phasewatch's dependencies (`PYTHON -m pip "
                        "install -r requirements.lock`); repeatable")
    p.add_argument("--capacity-rates", type=float, nargs="*", default=[],
                   help="then, at --capacity-concurrency streams, run each of these chunk "
                        "rates (chunks/s) and report the highest each path relays with chunk "
                        f"lag p99 under {CAPACITY_LAG_P99_MS:g} ms")
    p.add_argument("--capacity-concurrency", type=int, default=256)
    p.add_argument("--stored-rate", type=float, default=0,
                   help="requests/s of history stored in each phasewatch's database before it "
                        "starts: the window + baseline a diagnosis round reads, as an hour at "
                        "that rate leaves them (default 0: empty, a fresh install). The "
                        "benchmark's own rate is 50/s at every shape")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=None,
                   help="where to write results (default benchmarks/results/...json)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 16 streams, 1 repeat, 3 s per run")
    p.add_argument("--fail-on-miss", action="store_true",
                   help="exit 1 if a target that was measured is missed")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.repeats, args.duration, args.warmup = [16], 1, 3.0, 1.0
        args.chunk_rate = 0.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    shapes = {c: make_shape(args, c) for c in args.concurrency}
    paths = list(PATHS)
    nginx_note = ""
    if not (os.path.isfile(args.nginx) and os.access(args.nginx, os.X_OK)):
        paths.remove("nginx")
        nginx_note = f"nginx not found at {args.nginx}: the nginx column is skipped"
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    runs: list[Run] = []
    speed: dict[str, float] = {}
    capacity: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="phasewatch-bench-") as tmpname:
        tmp = Path(tmpname)
        servers: list[Server] = []
        try:
            upstream = start_upstream(args, tmp)
            servers.append(upstream)
            history = args.stored_rate
            proxies = {"phasewatch": start_phasewatch(upstream, tmp, stored_rate=history)}
            servers.append(proxies["phasewatch"])
            if args.baseline_source is not None:
                # The same phasewatch from another checkout, run beside this one.
                proxies["pw@base"] = start_phasewatch(
                    upstream, tmp, name="pw@base",
                    extra_env=source_env(args.baseline_source, tmp), stored_rate=history)
                servers.append(proxies["pw@base"])
                paths.insert(paths.index("phasewatch"), "pw@base")
            if args.otel:
                # OpenTelemetry switched on, exporting metrics (every 10 s) and every span.
                sink = OtlpSink()
                proxies["pw+otel"] = start_phasewatch(upstream, tmp, name="pw+otel", extra_env={
                    "PHASEWATCH_OTEL_ENABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
                    "OTEL_METRIC_EXPORT_INTERVAL": "10000"}, stored_rate=history)
                servers.append(proxies["pw+otel"])
                paths.insert(paths.index("phasewatch") + 1, "pw+otel")
            for name, env in parse_variants(args.variant):
                proxies[name] = start_phasewatch(upstream, tmp, name=name, extra_env=env,
                                                 stored_rate=history)
                servers.append(proxies[name])
                paths.insert(paths.index("phasewatch") + 1, name)
            for name, python in parse_interpreters(args.interpreter):
                # This checkout's code and native build, another interpreter.
                proxies[name] = start_phasewatch(upstream, tmp, name=name, stored_rate=history,
                                                 python=python)
                servers.append(proxies[name])
                paths.insert(paths.index("phasewatch") + 1, name)
            for workers in args.workers:
                if workers > 1:
                    server = start_phasewatch(upstream, tmp, workers, stored_rate=history)
                    proxies[server.name] = server
                    servers.append(server)
                    paths.insert(paths.index("phasewatch") + 1, server.name)
            if "nginx" in paths:
                try:
                    proxies["nginx"] = start_nginx(args.nginx, upstream, tmp)
                    servers.append(proxies["nginx"])
                    nginx_note = (f"nginx {nginx_version(args.nginx)} ({args.nginx}): "
                                  "proxy_buffering off, HTTP/1.1 upstream keepalive, 1 process")
                except RuntimeError as exc:
                    paths.remove("nginx")
                    nginx_note = f"nginx failed to start, column skipped: {exc}"
            targets = {"direct": upstream, **proxies}
            speed = calibrate()
            print_header(args, shapes, nginx_note, speed)
            for concurrency, shape in shapes.items():
                for repeat in range(args.repeats):
                    k = repeat % len(paths)
                    for path in paths[k:] + paths[:k]:
                        run = one_run(args, path, targets[path], upstream, proxies, shape,
                                      repeat, tmp)
                        runs.append(run)
                        print(f"  c={concurrency} repeat {repeat + 1}/{args.repeats} {path:<10} "
                              f"TTFT p99 {fmt(run.ttft_p99_ms)} ms, lag p99 "
                              f"{fmt(run.lag_p99_ms)} ms, CPU/chunk "
                              f"{fmt(run.proxy_cpu_us_per_chunk, ' us', digits=1)}, "
                              f"errors {sum(run.errors.values())}", flush=True)
                        time.sleep(0.5)
            if args.capacity_rates:
                capacity = measure_capacity(args, paths, targets, upstream, proxies, tmp, runs)
            for server in servers:
                if server.proc.poll() is not None:
                    print(f"WARNING: {server.name} exited during the benchmark:\n"
                          f"{server.log_tail()}")
        finally:
            for server in reversed(servers):
                stop(server)
    main_runs = [r for r in runs if r.extra.get("capacity") is None]
    summaries = {c: summarize(main_runs, c, paths) for c in args.concurrency}
    for c in args.concurrency:
        print_level(shapes[c], summaries[c], paths, args.loadgen_procs)
    if args.capacity_rates:
        print_capacity(args, capacity, paths)
    checks = check_targets(summaries)
    print("\ntargets:")
    for check in checks:
        verdict = {True: "MET", False: "MISSED", None: "not measured"}[check["met"]]
        print(f"  {check['target']}: {verdict} ({fmt(check['value'])})")
    out = args.json or HERE / "results" / f"proxy_overhead-{started.replace(':', '')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "started": started,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_after": os.getloadavg(), "nginx": nginx_note, "speed": speed,
                    "note": "upstream, proxies and load generator share these cores"},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "shapes": {str(c): asdict(shape) for c, shape in shapes.items()},
        "runs": [asdict(r) for r in runs],
        "summary": {str(c): s for c, s in summaries.items()},
        "capacity": capacity if args.capacity_rates else None,
        "targets": checks,
    }, indent=2))
    print(f"\nresults written to {out}")
    missed = any(check["met"] is False for check in checks)
    return 1 if missed and args.fail_on_miss else 0


def measure_capacity(args: argparse.Namespace, paths: Sequence[str],
                     targets: dict[str, Server], upstream: Server, proxies: dict[str, Server],
                     tmp: Path, runs: list[Run]) -> dict[str, Any]:
    """Each path at each chunk rate (same streams, shorter gaps); lag p99 and CPU per chunk,
    medians over repeats. The load generator and upstream share the cores with the proxy, so
    the rate at which lag gives way is this machine's, not the proxy's alone."""
    out: dict[str, Any] = {}
    for rate in args.capacity_rates:
        shape = make_shape(argparse.Namespace(**{**vars(args), "chunk_rate": rate}),
                           args.capacity_concurrency)
        per_path: dict[str, list[Run]] = {path: [] for path in paths}
        for repeat in range(args.repeats):
            k = repeat % len(paths)
            for path in [*paths[k:], *paths[:k]]:
                run = one_run(args, path, targets[path], upstream, proxies, shape, repeat, tmp)
                run.extra["capacity"] = rate
                runs.append(run)
                per_path[path].append(run)
                print(f"  capacity {rate:,.0f} chunks/s repeat {repeat + 1}/{args.repeats} "
                      f"{path:<14} lag p99 {fmt(run.lag_p99_ms)} ms, CPU/chunk "
                      f"{fmt(run.proxy_cpu_us_per_chunk, ' us', digits=1)}, errors "
                      f"{sum(run.errors.values())}", flush=True)
                time.sleep(0.5)
        out[str(rate)] = {path: {
            "lag_p99_ms": median([r.lag_p99_ms for r in mine]),
            "cpu_us_per_chunk": median([r.proxy_cpu_us_per_chunk for r in mine]),
            "errors": sum(sum(r.errors.values()) for r in mine),
        } for path, mine in per_path.items()}
    return out


def print_capacity(args: argparse.Namespace, capacity: dict[str, Any],
                   paths: Sequence[str]) -> None:
    print(f"\n== capacity at {args.capacity_concurrency} streams: chunk lag p99 (ms) / CPU per "
          f"chunk (us) by chunk rate; medians over {args.repeats} repeat(s) ==")
    print(f"{'chunks/s':>10}" + "".join(f"{path:>22}" for path in paths))
    for rate, entry in capacity.items():
        cells = "".join(
            f"{fmt(entry[p]['lag_p99_ms']) + ' / ' + fmt(entry[p]['cpu_us_per_chunk'], digits=1):>22}"  # noqa: E501
            for p in paths)
        print(f"{float(rate):>10,.0f}{cells}")
    print(f"highest rate with lag p99 < {CAPACITY_LAG_P99_MS:g} ms and no errors (the load "
          "generator and the upstream share the machine's cores; CPU per chunk does not "
          "depend on that):")
    for path in paths:
        held = [float(rate) for rate, entry in capacity.items()
                if entry[path]["lag_p99_ms"] is not None and not entry[path]["errors"]
                and entry[path]["lag_p99_ms"] < CAPACITY_LAG_P99_MS]
        print(f"  {path:<14} {max(held):,.0f} chunks/s" if held else
              f"  {path:<14} none of the rates tried")


def print_header(args: argparse.Namespace, shapes: dict[int, Shape], nginx_note: str,
                 speed: dict[str, float]) -> None:
    endpoint = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    print("phasewatch proxy overhead benchmark")
    for shape in shapes.values():
        print(f"  {shape.concurrency} streams: {args.chunks} content chunks, one every "
              f"{shape.interval_ms:g} ms, first after {args.first_delay_ms:g} ms "
              f"({shape.stream_s:.2f} s, {shape.concurrency * args.chunks / shape.stream_s:,.0f}"
              f" chunks/s); arrivals for {shape.duration:g} s, first {shape.warmup:g} s not "
              "measured")
    print(f"  {endpoint}, client stream_options: {args.client_usage}")
    if args.client_usage != "continuous":
        print("  (phasewatch asks the upstream for continuous usage and strips what the client "
              "did not ask for)")
    print(f"  open-loop Poisson arrivals, {args.repeats} repeat(s), medians over repeats; "
          f"{args.loadgen_procs} load generator process(es)")
    if args.stored_rate > 0:
        print(f"  each phasewatch's database holds the history of {args.stored_rate:g} "
              "requests/s over the span a diagnosis round reads (--stored-rate)")
    print(f"  {nginx_note or 'nginx: see below'}")
    print(f"  NOTE: upstream, proxy and load generator all share this machine's "
          f"{os.cpu_count()} CPU cores; load average now {os.getloadavg()[0]:.2f}")
    print(f"  machine speed (CPU time): perf_counter_ns {speed['perf_counter_ns_us']:.2f} us, "
          f"orjson.loads of a chunk {speed['orjson_loads_chunk_us']:.2f} us (0.05 and 0.5 us "
          f"where docs' performance facts were measured)")


if __name__ == "__main__":
    raise SystemExit(main())
