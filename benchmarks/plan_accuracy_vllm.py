"""The real-vLLM half of plan_accuracy.py: calibrate `phasewatch plan` at 2 closed-loop users
through the proxy in front of tests/vllm's vLLM, predict 8 and 16 users, then run them.

One vLLM (tests/vllm/server.py, its flags plus `--max-num-seqs` and `--max-num-batched-tokens`
below) with `phasewatch serve` in front, its own SQLite file. Each load is closed-loop users,
each sending its next streamed completion when its last ends, with prompts and outputs drawn
from the same lengths, for `seconds`; each load's requests carry their own run id.

1. Calibrate: 2 users. `phasewatch plan --from-run <2 users' run> --concurrency N
   --max-num-seqs CAP --max-num-batched-tokens BUDGET --json`, as an operator runs it, gives
   the predictions for 8 and 16 users before either runs.
2. Measure: 8 users, then 16. The truth is what the clients saw: TTFT (request sent -> first
   event with text) p95, and every gap between text events (ITL) p50 and p95, pooled over the
   requests that started after the load's first `warmup` seconds.

The error is predicted / measured - 1. Each row also separates the two halves of a prediction:
the calibrated engine alone, given the arrivals the proxy stored for that load (their own times
and lengths, `replay_observed`), against the TTFT p95 the proxy stored for them; the rest of the
error is the what-if's closed-loop users (when each sends its next request). `--keep DIR`
keeps the proxy's database and the clients' samples, so both can be computed again without
vLLM (`python -m benchmarks.plan_accuracy_vllm DIR`), with how each load's requests arrived
and ended together (`arrival_structure`).

`python -m benchmarks.plan_accuracy_vllm --flushes` runs 8 users straight to the vLLM and
through the proxy, in turns, twice, and counts on the clients' side the flushes (`flushes`:
several streams ending at once after one hold-up), to tell the engine's hold-ups from the
proxy's.

Everything (engine, proxy, clients) shares this machine's cores, so the engine's step time at
16 users includes contention the model does not know about; the figure is the whole system's,
as an operator on such a machine would see it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from benchmarks.diagnosis_scenarios import start_proxy, wait_http

MODEL = "pw-plan"
CAP, BUDGET = 32, 2048  # the engine's --max-num-seqs and --max-num-batched-tokens
PROMPT_WORDS = (64, 128, 256, 512)
OUTPUT_TOKENS = (32, 64, 128)
FIGURES = ("ttft_p95", "itl_p50", "itl_p95")
RUN_HEADER = "x-phasewatch-run-id"


@dataclass
class Load:
    users: int
    seconds: float
    warmup: float
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    requests: int = 0  # every request sent, measured or not
    # Each measured request's last text event and longest gap between two, as its client saw
    # them (time.monotonic() seconds).
    ends: list[tuple[float, float]] = field(default_factory=list)

    def figures(self) -> tuple[float, float, float]:
        return (_rank(self.ttft, 0.95), _rank(self.gaps, 0.5), _rank(self.gaps, 0.95))


def _rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def _user(session: aiohttp.ClientSession, url: str, run_id: str, load: Load,
                number: int, started: float) -> None:
    rng = random.Random(number)
    deadline = started + load.seconds
    while time.monotonic() < deadline:
        body = {"model": MODEL, "prompt": "word " * rng.choice(PROMPT_WORDS),
                "max_tokens": rng.choice(OUTPUT_TOKENS), "ignore_eos": True, "stream": True}
        sent = time.monotonic()
        stamps: list[float] = []
        async with session.post(url + "/v1/completions", json=body,
                                headers={RUN_HEADER: run_id}) as response:
            assert response.status == 200, await response.text()
            async for line in response.content:
                if line.startswith(b"data: {") and b'"text":""' not in line:
                    stamps.append(time.monotonic())
        load.requests += 1
        if sent - started >= load.warmup and stamps:
            load.ttft.append(stamps[0] - sent)
            gaps = [b - a for a, b in itertools.pairwise(stamps)]
            load.gaps.extend(gaps)
            load.ends.append((stamps[-1], max(gaps, default=0.0)))


async def run_load(url: str, run_id: str, load: Load) -> Load:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.monotonic()
        await asyncio.gather(*(_user(session, url, run_id, load, n, started)
                               for n in range(load.users)))
    return load


def plan(database_url: str, run_id: str, users: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "phasewatch.cli", "plan", "--database-url", database_url,
         "--from-run", run_id, "--concurrency", str(users), "--max-num-seqs", str(CAP),
         "--max-num-batched-tokens", str(BUDGET), "--json"],
        capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"phasewatch plan refused: {done.stderr.strip()}")
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def _stored(proxy: str, at_least: int) -> None:
    """Wait until the proxy has stored `at_least` records (its writer flushes in batches)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in httpx.get(proxy + "/metrics").text.splitlines():
            if line.startswith("phasewatch_records_written_total "):
                if float(line.split()[1]) >= at_least:
                    return
        time.sleep(0.5)
    raise SystemExit("the proxy did not store every record within 60 s")


def engine_alone(database_url: str, runs: dict[int, str],
                 warmup: float) -> dict[int, tuple[float, float]]:
    """Per load (users -> run id): (stored TTFT p95, the calibrated engine's TTFT p95 on the
    same arrivals), in seconds, over the requests after the load's first `warmup` seconds.
    The calibration is `phasewatch plan`'s, on the run named `calibrate`."""
    from phasewatch.core.db import create_engine, create_sessionmaker
    from phasewatch.plan.fit import calibrate
    from phasewatch.plan.refine import refine
    from phasewatch.plan.traffic import Request
    from phasewatch.plan.whatif import Limits, replay_observed
    from phasewatch.store.plan_inputs import timed_requests

    async def read(run_id: str) -> list[Request]:
        engine = create_engine(database_url)
        try:
            async with create_sessionmaker(engine)() as session:
                rows = await timed_requests(session, model=MODEL, run_id=run_id)
        finally:
            await engine.dispose()
        return [Request(*row) for row in rows]

    limits = Limits(CAP, BUDGET)
    seen = asyncio.run(read("calibrate"))
    calibration = refine(calibrate(seen, CAP), limits, seen)
    out = {}
    for users, run_id in runs.items():
        stored = asyncio.run(read(run_id))
        replayed = replay_observed(calibration, limits, [
            (r.started_s, r.prompt_tokens, r.output_tokens) for r in stored])
        counted = [i for i, r in enumerate(stored)
                   if r.started_s - stored[0].started_s >= warmup]
        out[users] = (_rank([stored[i].ttft_s for i in counted], 0.95),
                      _rank([replayed[i] for i in counted], 0.95))
    return out


def _keep(directory: Path, database: Path, truth: dict[int, Load]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # SQLite's backup, not a file copy: the proxy's database is in WAL mode, and the records
    # written since its last checkpoint are in the -wal file beside it, not in the file.
    kept = directory / "plan.db"
    kept.unlink(missing_ok=True)
    with closing(sqlite3.connect(database)) as source, closing(sqlite3.connect(kept)) as copy:
        source.backup(copy)
    (directory / "truth.json").write_text(json.dumps({
        str(users): {"ttft_s": load.ttft, "gaps_s": load.gaps, "requests": load.requests,
                     "seconds": load.seconds, "warmup": load.warmup, "ends": load.ends}
        for users, load in truth.items()}))


def rows_for(database_url: str, truth: dict[int, Load],
             predicted: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the predicted loads in `truth` (users -> what the clients saw; the
    calibration's users first) against `phasewatch plan`'s answers for them."""
    calibrate_users, *predict_users = truth
    calibration = truth[calibrate_users]
    alone = engine_alone(database_url, {users: f"users-{users}" for users in predict_users},
                         calibration.warmup)
    rows = []
    for users in predict_users:
        load = truth[users]
        got = predicted[users]["predicted"]
        guess = (got["ttft_p95_s"], got["itl_p50_s"], got["itl_p95_s"])
        measured = load.figures()
        stored_p95, replayed_p95 = alone[users]
        rows.append({
            "gpu": "vllm-cpu", "model": MODEL,
            "case": f"{users // calibrate_users}x users ({users} users, cap {CAP})",
            "users": users, "max_num_seqs": CAP,
            "measured_requests": len(load.ttft),
            "measured_ms": dict(zip(FIGURES, (v * 1e3 for v in measured), strict=True)),
            "predicted_ms": dict(zip(FIGURES, (v * 1e3 for v in guess), strict=True)),
            "error": dict(zip(FIGURES, (p / t - 1 for p, t in zip(guess, measured, strict=True)),
                              strict=True)),
            "engine_alone": {"stored_ttft_p95_ms": stored_p95 * 1e3,
                             "replayed_ttft_p95_ms": replayed_p95 * 1e3,
                             "error": replayed_p95 / stored_p95 - 1},
            "refused": predicted[users]["calibration"]["refused"],
            "extrapolated": predicted[users].get("extrapolated"),
            "calibration_requests": calibration.requests,
            "calibration_measured_ms": dict(zip(
                FIGURES, (v * 1e3 for v in calibration.figures()), strict=True)),
        })
    return rows


@contextmanager
def _stack(name: str) -> Iterator[tuple[str, str, Path]]:
    """tests/vllm's vLLM with this benchmark's engine flags, and `phasewatch serve` in front
    of it on its own SQLite file: (vLLM's URL, the proxy's URL, their working directory)."""
    from tests.vllm.server import locate, running_vllm  # the benchmark's only use of tests/

    env = locate()
    if not env.ready:
        raise SystemExit("the vLLM test environment is not built: run `make vllm-env`")
    with tempfile.TemporaryDirectory(prefix="plan-vllm-") as tmp:
        workdir = Path(tmp)
        flags = ("--max-num-seqs", str(CAP), "--max-num-batched-tokens", str(BUDGET))
        with running_vllm(env, workdir, served_model_name=MODEL, engine_args=flags) as vllm:
            proxy, proc = start_proxy(vllm.url, workdir, name)
            try:
                wait_http(proxy + "/api/health", proc)
                yield vllm.url, proxy, workdir
            finally:
                proc.terminate()
                proc.wait(timeout=15)


def accuracy(calibrate_users: int = 2, predict_users: tuple[int, ...] = (8, 16),
             seconds: float = 90.0, warmup: float = 15.0,
             keep: Path | None = None) -> list[dict[str, Any]]:
    """Rows as plan_accuracy.py prints them: one per predicted load. `keep`: a directory for
    the proxy's database (`plan.db`) and the clients' samples (`truth.json`)."""
    with _stack("plan") as (_, proxy, workdir):
        database_url = f"sqlite+aiosqlite:///{workdir}/plan.db"
        calibration = asyncio.run(run_load(
            proxy, "calibrate", Load(calibrate_users, 2 * seconds, warmup)))
        _stored(proxy, calibration.requests)
        predicted = {users: plan(database_url, "calibrate", users) for users in predict_users}
        sent = calibration.requests
        truth = {calibrate_users: calibration}
        for users in predict_users:
            truth[users] = asyncio.run(run_load(proxy, f"users-{users}",
                                                Load(users, seconds, warmup)))
            sent += truth[users].requests
        _stored(proxy, sent)
        if keep is not None:
            _keep(keep, workdir / "plan.db", truth)
        rows = rows_for(database_url, truth, predicted)
    return rows


def kept(directory: Path) -> list[dict[str, Any]]:
    """The rows again, from a directory `--keep` wrote (no vLLM): `phasewatch plan` on its
    database, against its clients' samples."""
    database_url = f"sqlite+aiosqlite:///{directory / 'plan.db'}"
    truth = {}
    for users, saved in json.loads((directory / "truth.json").read_text()).items():
        load = Load(int(users), saved["seconds"], saved["warmup"], saved["ttft_s"],
                    saved["gaps_s"], saved["requests"])
        truth[load.users] = load
    _, *predict_users = truth
    return rows_for(database_url, truth,
                    {users: plan(database_url, "calibrate", users) for users in predict_users})


def arrival_structure(directory: Path, near_s: float = 0.002) -> dict[str, dict[str, float]]:
    """How the stored requests of each kept load (run id -> figures) arrived and ended
    together, after its warm-up: the share that arrived within `near_s` of another, the most
    that arrived within `near_s` of one, and the flushes (three or more requests that ended
    within `near_s` of each other, each after the same longest token gap, to `near_s`: a
    backlog of tokens delivered at once). The clients' share of token gaps under 0.5 ms (two
    events in one read) is from their samples."""
    truth = json.loads((directory / "truth.json").read_text())
    out = {}
    with closing(sqlite3.connect(directory / "plan.db")) as db:
        for users, saved in truth.items():
            run_id = "calibrate" if users == next(iter(truth)) else f"users-{users}"
            rows = db.execute(
                "SELECT started_at, e2e_s, itl_max_s FROM requests WHERE run_id = ? "
                "AND outcome = 'ok' ORDER BY started_at", (run_id,)).fetchall()
            starts = [_seconds(r[0]) for r in rows]
            counted = [r for r, at in zip(rows, starts, strict=True)
                       if at - starts[0] >= saved["warmup"]]
            arrivals = sorted(_seconds(r[0]) for r in counted)
            together = [sum(1 for b in arrivals if abs(b - a) <= near_s) for a in arrivals]
            gaps = saved["gaps_s"]
            out[run_id] = {
                "requests": len(arrivals),
                "arrived_together": sum(n > 1 for n in together) / max(len(arrivals), 1),
                "most_together": max(together, default=0),
                "flushes": len(flushes([(_seconds(r[0]) + r[1], r[2] or 0.0) for r in counted],
                                       near_s)),
                "client_gaps_under_0_5ms": sum(g < 0.0005 for g in gaps) / max(len(gaps), 1)}
            if "ends" in saved:  # (kept runs before the clients recorded them have none)
                out[run_id]["client_flushes"] = len(flushes(saved["ends"], near_s))
    return out


def flushes(ends: list[tuple[float, float]], near_s: float = 0.002) -> list[tuple[int, float]]:
    """(requests, longest gap) of each flush among `ends` ((end, longest gap) per request):
    three or more requests that ended within `near_s` of each other, each after the same
    longest gap, to `near_s`. Streams of different lengths end together so only when their
    last tokens were delivered at once, after a hold-up they all waited through."""
    found: list[tuple[int, float]] = []
    group: list[tuple[float, float]] = []
    for end, gap in [*sorted(ends), (math.inf, math.inf)]:
        if group and end - group[-1][0] <= near_s and abs(gap - group[0][1]) <= near_s:
            group.append((end, gap))
            continue
        if len(group) >= 3:
            found.append((len(group), group[0][1]))
        group = [(end, gap)]
    return found


def direct_and_through(users: int = 8, seconds: float = 75.0, rounds: int = 2,
                       warmup: float = 15.0) -> list[tuple[str, Load]]:
    """The same closed-loop load straight to the vLLM and through `phasewatch serve`, in
    turns, in one vLLM session: whether the hold-ups that flush several streams at once are
    the engine's or the proxy's."""
    out = []
    with _stack("flushes") as (vllm, proxy, _):
        for turn in range(rounds):
            for path, url in (("direct", vllm), ("phasewatch", proxy)):
                out.append((path, asyncio.run(run_load(url, f"{path}-{turn}",
                                                       Load(users, seconds, warmup)))))
    return out


def _seconds(stored: str) -> float:
    return datetime.fromisoformat(stored.replace("Z", "+00:00")).timestamp()


def _main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m benchmarks.plan_accuracy_vllm (KEPT_DIR | --flushes)")
    if sys.argv[1] == "--flushes":
        for path, load in direct_and_through():
            found = flushes(load.ends)
            print(f"{path:10s} {load.users} users: {len(load.ttft)} requests, TTFT p95 "
                  f"{load.figures()[0] * 1e3:.0f} ms, {len(found)} flushes "
                  f"(requests, longest gap ms): {[(n, round(g * 1e3)) for n, g in found]}")
        return
    for row in kept(Path(sys.argv[1])):
        alone = row["engine_alone"]
        print(f"{row['case']:28s} " + " ".join(f"{f} {row['error'][f]:+.0%}" for f in FIGURES)
              + f"  engine alone on the stored arrivals: TTFT p95 {alone['error']:+.0%}")
    for run_id, got in arrival_structure(Path(sys.argv[1])).items():
        print(f"{run_id:10s} {got['requests']} requests: {got['arrived_together']:.0%} arrived "
              f"within 2 ms of another (at most {got['most_together']} at once); "
              f"{got['flushes']} flushes (the clients: {got.get('client_flushes', '-')}); "
              f"client token gaps under 0.5 ms: {got['client_gaps_under_0_5ms']:.1%}")


if __name__ == "__main__":
    _main()
