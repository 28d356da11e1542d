"""Store scale benchmark: the record writer's sustained rate, and `/api/stats` over big tables.

Part `writer` (per backend, SQLite file and Postgres on 127.0.0.1:5432):
  A fast fake vLLM (`fast_upstream.py`) and phasewatch's app run here, the app under uvicorn in
  this process's event loop, exactly as `phasewatch serve` builds it. The load generator
  (`loadgen.py`, another process) streams through the proxy at a steady concurrency, twice:
  once quiet, once while a flood task in the proxy's own loop offers synthetic records to the
  record queue at `--rate` per second (the relay's records are stored as well). It prints the
  records stored per second during the flood, the drops, the deepest queue, and the relay's TTFT
  and chunk lag p50/p99 quiet vs flooded: the writer shares the relay's event loop, so this is
  where it would show.

Part `stats` (per backend, per `--rows`):
  Bulk-loads N synthetic request rows spread evenly over 30 days up to now (Postgres: COPY;
  SQLite: executemany in large transactions), then times `GET /api/stats?window=5m&by=model`
  through the real API at 30 random points in that range, and the first page of
  `GET /api/requests`. Medians and p95 of wall time per call, client side.

Part `diagnosis` (per backend, per `--diagnosis-rates`):
  The diagnosis schedule's cost at steady state. Bulk-loads the requests a steady rate leaves
  in the span one round reads (the window and the baseline before it, default 300 + 3,600 s),
  spread evenly up to now over three models, then runs `--rounds` rounds of the schedule
  (`DiagnosisService.evaluate_all`, as the leading process runs it every
  `PHASEWATCH_DIAGNOSIS_INTERVAL_S`) and prints the median CPU of this process per round (its
  event loop, the driver's thread and the statistics' thread; Postgres's own CPU is not in it),
  that as a share of a core at the default interval and per request served at that rate, and
  the statements that took longest. The pure core's share of it: `diagnosis_round.py`.

Run: `.venv/bin/python benchmarks/store_scale.py [writer] [stats] [diagnosis] [--rows ...]`,
`--quick` for a smoke run. Needs PostgreSQL on 127.0.0.1:5432 (trust auth) for the Postgres
columns; creates and drops its own databases there. Writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import httpx
import uvicorn
from prometheus_client import CollectorRegistry

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from benchmarks.proxy_overhead import free_port, percentile_ms  # noqa: E402
from phasewatch.core.db import create_engine, create_sessionmaker  # noqa: E402
from phasewatch.core.records import Outcome, RequestRecord  # noqa: E402
from phasewatch.core.settings import Settings, load_settings  # noqa: E402
from phasewatch.diagnosis.service import DiagnosisService  # noqa: E402
from phasewatch.main import create_app  # noqa: E402
from phasewatch.store.migrate import upgrade  # noqa: E402
from phasewatch.store.retention import retention_pass  # noqa: E402

ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
MODELS = ("qwen-0.5b", "llama-8b", "mistral-7b")


# ---------------------------------------------------------------------------- databases


async def _admin(sql: str) -> None:
    connection = await asyncpg.connect(ADMIN, timeout=5)
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


async def new_database(backend: str, tmp: Path) -> str:
    if backend == "sqlite":
        return f"sqlite+aiosqlite:///{tmp / f'bench-{uuid.uuid4().hex[:8]}.db'}"
    name = f"pw_bench_{uuid.uuid4().hex[:8]}"
    await _admin(f'CREATE DATABASE "{name}"')
    return f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"


@asynccontextmanager
async def migrated_database(backend: str, tmp: Path) -> AsyncIterator[str]:
    """A new database of `backend` at the schema's head, dropped when the block ends."""
    url = await new_database(backend, tmp)
    try:
        await asyncio.to_thread(upgrade, url)
        yield url
    finally:
        await drop_database(url)


async def drop_database(url: str) -> None:
    if url.startswith("postgresql"):
        await _admin(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
    else:
        path = url.split(":///", 1)[1]
        for suffix in ("", "-wal", "-shm"):
            await asyncio.to_thread(Path(path + suffix).unlink, missing_ok=True)


# ---------------------------------------------------------------------------- the app here


class InProcessProxy:
    """phasewatch's app under uvicorn in this event loop, so a flood task can share its loop."""

    def __init__(self, upstream: str, database_url: str, queue_size: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.registry = CollectorRegistry()
        settings = load_settings(upstream_url=upstream, database_url=database_url,
                                 record_queue_size=queue_size, log_level="warning",
                                 admin_open=True)
        self.app = create_app(settings, registry=self.registry)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                loop="none", http="httptools", backlog=4096)
        self.server = uvicorn.Server(config)
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> InProcessProxy:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:  # noqa: ASYNC110 - uvicorn offers only this flag
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.server.should_exit = True
        assert self.task is not None
        await self.task

    def sample(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0


def synthetic_record(i: int, now: datetime) -> RequestRecord:
    return RequestRecord(
        request_id=f"flood-{i}", started_at=now, endpoint="completions",
        model=MODELS[i % 3], upstream="http://bench", stream=True, outcome=Outcome.OK,
        http_status=200, in_flight_at_arrival=i % 64, ttft_s=0.05, e2e_s=1.3, tpot_s=0.02,
        itl_count=63, itl_mean_s=0.02, itl_p50_s=0.02, itl_p95_s=0.025, itl_max_s=0.05,
        prompt_tokens=256, output_tokens=64, tokens_exact=True, run_id=None, error=None,
    )


async def flood(proxy: InProcessProxy, rate: float, seconds: float) -> dict[str, float]:
    """Offer `rate` records a second to the proxy's queue, in 10 ms ticks, for `seconds`."""
    queue = proxy.app.state.proxy.records
    loop = asyncio.get_running_loop()
    start = loop.time()
    offered = 0
    deepest = 0
    lateness: list[float] = []
    tick = 0.01
    while (elapsed := loop.time() - start) < seconds:
        due = int(rate * elapsed) - offered
        now = datetime.now(UTC)
        for _ in range(max(0, due)):
            queue.offer(synthetic_record(offered, now))
            offered += 1
        deepest = max(deepest, queue.qsize())
        target = start + (int(elapsed / tick) + 1) * tick
        await asyncio.sleep(max(0.0, target - loop.time()))
        lateness.append(max(0.0, loop.time() - target))
    return {"offered": offered, "deepest_queue": deepest,
            "loop_lateness_p99_ms": sorted(lateness)[int(0.99 * (len(lateness) - 1))] * 1e3}


async def loadgen(url: str, rate: float, duration: float, tmp: Path, seed: int) -> dict[str, Any]:
    out = tmp / f"loadgen-{seed}.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "loadgen.py"), "--url", url, "--tokens", "64",
        "--rate", str(rate), "--duration", str(duration), "--warmup", "1.5",
        "--seed", str(seed), "--out", str(out), cwd=REPO, stdin=subprocess.DEVNULL)
    if await proc.wait() != 0:
        raise RuntimeError("load generator failed")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


async def writer_part(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    port = free_port()
    upstream = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "fast_upstream.py"), "--port", str(port),
        "--interval-ms", "20", "--first-delay-ms", "20", cwd=REPO, stdin=subprocess.DEVNULL)
    results = []
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(100):
                try:
                    await client.get(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
        stream_s = 64 * 0.02 + 0.02
        load_rate = args.streams / stream_s  # open-loop arrivals holding ~N streams
        for backend in args.backends:
            rate = args.rate or (5000.0 if backend == "postgres" else 2000.0)
            async with migrated_database(backend, tmp) as url:
                async with InProcessProxy(f"http://127.0.0.1:{port}", url,
                                          queue_size=max(10_000, int(rate * 4))) as proxy:
                    quiet = await loadgen(proxy.url, load_rate, args.seconds, tmp, 1)
                    written0 = proxy.sample("phasewatch_records_written_total")
                    dropped0 = proxy.sample("phasewatch_records_dropped_total")
                    t0 = time.monotonic()
                    flooded, offered = await asyncio.gather(
                        loadgen(proxy.url, load_rate, args.seconds, tmp, 1),
                        flood(proxy, rate, args.seconds + 1.5))
                    elapsed = time.monotonic() - t0
                    written = proxy.sample("phasewatch_records_written_total") - written0
                    dropped = proxy.sample("phasewatch_records_dropped_total") - dropped0
                row = {
                    "backend": backend, "offered_rate": rate, "elapsed_s": elapsed,
                    "stored_per_s": written / elapsed, "dropped": dropped, **offered,
                    "quiet": relay_figures(quiet), "flooded": relay_figures(flooded),
                }
                results.append(row)
                print_writer_row(row)
    finally:
        upstream.terminate()
        await upstream.wait()
    return results


def relay_figures(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "requests": run["measured"], "errors": run["errors"],
        "ttft_p50_ms": percentile_ms(run["ttft_ns"], 0.5),
        "ttft_p99_ms": percentile_ms(run["ttft_ns"], 0.99),
        "lag_p50_ms": percentile_ms(run["lag_ns"], 0.5),
        "lag_p99_ms": percentile_ms(run["lag_ns"], 0.99),
    }


def print_writer_row(row: dict[str, Any]) -> None:
    q, f = row["quiet"], row["flooded"]
    print(f"\n[writer] {row['backend']}: offered {row['offered_rate']:.0f} records/s for "
          f"{row['elapsed_s']:.1f} s -> stored {row['stored_per_s']:.0f}/s, dropped "
          f"{row['dropped']:.0f}, deepest queue {row['deepest_queue']}, flood loop lateness "
          f"p99 {row['loop_lateness_p99_ms']:.1f} ms")
    print("  relay (same loop)   TTFT p50/p99 ms   chunk lag p50/p99 ms   requests")
    for name, r in (("quiet", q), ("with flood", f)):
        print(f"  {name:<18} {r['ttft_p50_ms']:7.2f} / {r['ttft_p99_ms']:7.2f}   "
              f"{r['lag_p50_ms']:7.2f} / {r['lag_p99_ms']:7.2f}        {r['requests']}")
    print(f"  flooded / quiet: TTFT p99 x{f['ttft_p99_ms'] / q['ttft_p99_ms']:.2f}, "
          f"lag p99 x{f['lag_p99_ms'] / q['lag_p99_ms']:.2f}")


# ---------------------------------------------------------------------------- stats at scale

COLUMNS = (
    "request_id", "started_at", "endpoint", "model", "upstream", "stream", "outcome",
    "http_status", "in_flight_at_arrival", "ttft_s", "e2e_s", "tpot_s", "itl_count",
    "itl_mean_s", "itl_p50_s", "itl_p95_s", "itl_max_s", "prompt_tokens", "output_tokens",
    "tokens_exact", "run_id", "error",
)


def synthetic_rows(offset: int, n: int, total: int, end: datetime,
                   days: float) -> list[tuple[Any, ...]]:
    """Rows `offset`..`offset + n` of `total`, evenly spaced over `days` up to `end`."""
    rng = random.Random(offset)
    step = timedelta(days=days) / total
    start = end - timedelta(days=days)
    rows = []
    for i in range(offset, offset + n):
        ttft = rng.lognormvariate(-2.5, 0.6)
        itl = rng.lognormvariate(-4.0, 0.3)
        ok = rng.random() > 0.01
        rows.append((
            f"r{i}", start + step * (i + 1), "chat.completions", MODELS[i % 3],
            "http://vllm:8000", True, "ok" if ok else "stream_error", 200, rng.randrange(64),
            ttft, ttft + 127 * itl, itl, 127, itl, itl, itl * 1.3, itl * 2,
            rng.randrange(64, 4096), 128, True, None,
            None if ok else "in-band error from upstream",
        ))
    return rows


async def load_rows(url: str, total: int, end: datetime, days: float) -> float:
    """Bulk-load `total` synthetic rows; returns seconds taken."""
    started = time.monotonic()
    chunk = 200_000
    if url.startswith("postgresql"):
        connection = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        try:
            for offset in range(0, total, chunk):
                part = synthetic_rows(offset, min(chunk, total - offset), total, end, days)
                await connection.copy_records_to_table("requests", records=part,
                                                       columns=list(COLUMNS))
            await connection.execute("ANALYZE requests")
        finally:
            await connection.close()
    else:
        db = sqlite3.connect(url.split(":///", 1)[1])
        db.execute("PRAGMA synchronous=OFF")  # loading only: the benchmark times reads
        sql = (f"INSERT INTO requests ({', '.join(COLUMNS)}) "
               f"VALUES ({', '.join('?' * len(COLUMNS))})")
        for offset in range(0, total, chunk):
            part = synthetic_rows(offset, min(chunk, total - offset), total, end, days)
            # The format SQLAlchemy's SQLite dialect writes, so range queries compare right.
            db.executemany(sql, [(r[0], r[1].strftime("%Y-%m-%d %H:%M:%S.%f"), *r[2:])
                                 for r in part])
            db.commit()
        db.execute("ANALYZE")
        db.close()
    return time.monotonic() - started


async def stats_part(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    results = []
    for backend in args.backends:
        for total in args.rows:
            async with migrated_database(backend, tmp) as url:
                end = datetime.now(UTC).replace(microsecond=0)
                days = 30.0
                load_s = await load_rows(url, total, end, days)
                # Steady state: the backlog rolled up once, as retention does at its first pass
                # (timed: the cost of starting on a big table that has no rollups yet).
                engine = create_engine(url)
                started = time.monotonic()
                await retention_pass(engine, None)
                rollup_s = time.monotonic() - started
                await engine.dispose()
                async with InProcessProxy("http://127.0.0.1:9", url, 1000) as proxy:
                    timings = await time_api(proxy.url, end, days, args.calls)
                row = {"backend": backend, "rows": total, "load_s": load_s, "rollup_s": rollup_s,
                       "rows_per_5m_window": total / (days * 24 * 12), **timings}
                results.append(row)
                print(f"\n[stats] {backend}, {total:,} rows (loaded in {load_s:.0f} s, first "
                      f"rollup {rollup_s:.0f} s, ~{row['rows_per_5m_window']:.0f} rows per "
                      "5-minute window):")
                for name in ("stats_5m_by_model", "stats_1h_by_model", "requests_page"):
                    t = timings[name]
                    print(f"  {name:<20} median {t['median_ms']:7.1f} ms   "
                          f"p95 {t['p95_ms']:7.1f} ms   ({t['calls']} calls)")
    return results


async def diagnosis_part(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    defaults = Settings()
    span_s = defaults.diagnosis_window_s + defaults.diagnosis_baseline_s
    interval_s = defaults.diagnosis_interval_s
    results = []
    for backend in args.backends:
        for rate in args.diagnosis_rates:
            async with migrated_database(backend, tmp) as url:
                end = datetime.now(UTC)
                total = int(rate * span_s)
                await load_rows(url, total, end, span_s / 86400)
                engine = create_engine(url)
                statements: dict[str, list[float]] = {}
                watch_statements(engine, statements)
                service = DiagnosisService(create_sessionmaker(engine),
                                           load_settings(database_url=url))
                cpu_ms, wall_ms = [], []
                for _ in range(args.rounds):
                    cpu, wall = time.process_time(), time.perf_counter()
                    verdicts = await service.evaluate_all()
                    cpu_ms.append((time.process_time() - cpu) * 1000)
                    wall_ms.append((time.perf_counter() - wall) * 1000)
                await engine.dispose()
            per_round = statistics.median(cpu_ms)
            row = {"backend": backend, "rate": rate, "rows_in_span": total,
                   "models": len(verdicts), "rounds": args.rounds,
                   "cpu_ms_per_round": per_round, "wall_ms_per_round": statistics.median(wall_ms),
                   "core_share": per_round / 1000 / interval_s,
                   "cpu_us_per_request": per_round * 1000 / (rate * interval_s),
                   "statements": {sql: {"calls": len(t), "ms_per_round": sum(t) / args.rounds}
                                  for sql, t in statements.items()}}
            results.append(row)
            print(f"\n[diagnosis] {backend}, {rate:g} requests/s ({total:,} rows in the "
                  f"{span_s:.0f} s a round reads, {row['models']} models): CPU per round "
                  f"median {per_round:.0f} ms (wall {row['wall_ms_per_round']:.0f} ms) = "
                  f"{100 * row['core_share']:.1f}% of a core every {interval_s:g} s = "
                  f"{row['cpu_us_per_request']:.0f} us per request served")
            slowest = sorted(row["statements"].items(), key=lambda kv: -kv[1]["ms_per_round"])
            for sql, t in slowest[:4]:
                print(f"  {t['ms_per_round']:7.1f} ms/round  {t['calls'] // args.rounds}x  "
                      f"{sql[:110]}")
    return results


def watch_statements(engine: Any, into: dict[str, list[float]]) -> None:
    """Time each statement's execution (not its rows' fetching), by its text."""
    from sqlalchemy import event

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def before(conn: Any, *_: Any) -> None:
        conn.info["pw_started"] = time.perf_counter()

    @event.listens_for(engine.sync_engine, "after_cursor_execute")
    def after(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        key = " ".join(statement.split())
        into.setdefault(key, []).append((time.perf_counter() - conn.info["pw_started"]) * 1000)


async def time_api(base: str, end: datetime, days: float, calls: int) -> dict[str, Any]:
    rng = random.Random(7)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        queries: tuple[tuple[str, str, dict[str, str | int]], ...] = (
            ("stats_5m_by_model", "/api/stats", {"window": "5m", "by": "model"}),
            ("stats_1h_by_model", "/api/stats", {"window": "1h", "by": "model"}),
            ("requests_page", "/api/requests", {"limit": 100}),
        )
        for name, path, params in queries:
            times = []
            for _ in range(calls):
                until = end - timedelta(days=days * rng.random() * 0.95)
                query = {**params, "until": until.isoformat()} if "stats" in path else params
                t0 = time.perf_counter()
                response = await client.get(path, params=query)
                times.append((time.perf_counter() - t0) * 1e3)
                response.raise_for_status()
            times.sort()
            out[name] = {"calls": calls, "median_ms": statistics.median(times),
                         "p95_ms": times[int(0.95 * (len(times) - 1))]}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", help="writer, stats, diagnosis (default: all)")
    parser.add_argument("--backends", nargs="+", choices=["sqlite", "postgres"],
                        default=["sqlite", "postgres"])
    parser.add_argument("--rate", type=float, help="records/s to offer (default: the target)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=32, help="relay concurrency meanwhile")
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--diagnosis-rates", type=float, nargs="+", default=[10, 50, 200],
                        help="steady requests/s whose stored span the diagnosis reads")
    parser.add_argument("--rounds", type=int, default=5, help="diagnosis rounds timed")
    parser.add_argument("--quick", action="store_true", help="smoke run: small and short")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "store_scale.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.rows, args.calls, args.streams = 3.0, [50_000], 5, 8
        args.diagnosis_rates, args.rounds = [5], 2
    parts = args.parts or ["writer", "stats", "diagnosis"]
    if set(parts) - {"writer", "stats", "diagnosis"}:
        parser.error("parts are: writer, stats, diagnosis")
    print("Upstream, proxy, writer, database and load generator share this machine's cores.")

    async def run() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="pw-store-") as name:
            tmp = Path(name)
            out: dict[str, Any] = {}
            if "writer" in parts:
                out["writer"] = await writer_part(args, tmp)
            if "stats" in parts:
                out["stats"] = await stats_part(args, tmp)
            if "diagnosis" in parts:
                out["diagnosis"] = await diagnosis_part(args, tmp)
            return out

    import uvloop
    result = uvloop.run(run())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
