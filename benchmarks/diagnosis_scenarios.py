"""The diagnosis scenario suite: a known fault on the simulator, traffic through phasewatch, and
the verdict phasewatch gives for it.

Each scenario starts the simulator (`python -m phasewatch.sim`) with its own flags and the proxy
(`python -m phasewatch.cli serve`, its own SQLite file, engine metrics scraped every 0.5 s, the
diagnosis schedule off) in front of it, each a subprocess on a free loopback port. It drives a
baseline phase of traffic and then a window phase through the proxy, waits until the proxy has
stored every request, and asks `GET /api/diagnosis` with the two phases as explicit time ranges
(`until` + `window`, `baseline=<start>/<end>`), so nothing waits for wall-clock hours.

Scenarios (simulator flags; baseline -> window; the verdict expected):
- steady: T4 defaults; 6 req/s, prompts 100-400 tokens -> the same; healthy. Also one long
  run of it judged window by window (false alarms).
- queueing: `--max-num-seqs 4`; 3 users -> 12 users; queueing.
- decode_saturation: `--peak-tflops 8`; 4 users -> 32 users (under the 256 cap), prompts
  8-24, outputs 32-96; decode_saturation.
- out_of_capacity: `--peak-tflops 8 --max-num-seqs 32`; 4 users -> 64 users; out_of_capacity.
  (With `--max-num-seqs 16` ITL only rises 10 -> 14 ms: under the default 40 ms ITL objective
  that rise does not matter, and the verdict is queueing; docs/diagnosis.md, "Against the
  SLO". A batch of 32 doubles ITL.)
- prefill_bound: `--max-num-batched-tokens 512`; 6 req/s, prompts 100-400 -> 6 req/s, 70% of
  prompts 1500-3000; prefill_bound (not queueing).
- interference: `--no-enable-chunked-prefill`; 6 req/s, prompts 100-400 -> 6 req/s, 40% of
  prompts 2000-4000; interference.
- kv_pressure: `--max-model-len 2048 --kv-cache-blocks 256`; 3 users -> 16 users, prompts
  400-800; kv_pressure (from the engine's metrics).

"Users" are closed-loop clients (each sends its next request when the last one ends, after a
random pause); "req/s" are open-loop Poisson arrivals. Output lengths are drawn per request so
users do not fall into lockstep. `--peak-tflops 8` gives a GPU whose ridge point is ~9
FLOPs/byte, so decode turns compute-bound at a batch of ~9 instead of ~200: the mechanism of
decode saturation at a concurrency this machine can drive.

Run: `.venv/bin/python benchmarks/diagnosis_scenarios.py [--repeats 3] [--scenario NAME ...]
[--steady-windows 20] [--json out.json]`. It prints every verdict, the confusion matrix over
all scenarios and repeats, and the false alarms of the long steady run. Onset timing, with the
schedule running, is `benchmarks/diagnosis_onsets.py`.
`tests/diagnosis/test_scenarios.py` runs each scenario once through the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from phasewatch.diagnosis.verdicts import Verdict  # noqa: E402

MODEL = "sim"


@dataclass(frozen=True)
class Phase:
    """One phase of traffic, in model seconds (wall = model x the simulator's time-scale)."""

    seconds: float
    rate: float | None = None  # open loop: Poisson arrivals per model second
    users: int | None = None  # closed loop: users sending back to back
    # Prompt mixture: (weight, min tokens, max tokens), drawn per request.
    prompts: tuple[tuple[float, int, int], ...] = ((1.0, 100, 400),)
    outputs: tuple[int, int] = (16, 48)
    think_s: float = 0.3  # closed loop: a pause uniform in [0, think_s] between requests
    # Closed loop: go on past `seconds` (up to 3x) until this many requests were sent, so a
    # machine slowed by other work still gives the phase enough samples.
    min_requests: int = 32


@dataclass(frozen=True)
class Scenario:
    name: str
    expect: Verdict
    flags: tuple[str, ...]
    baseline: Phase
    window: Phase
    time_scale: float = 1.0
    settle_s: float = 0.5  # model seconds at the window's start left out (the change sets in)


SHORT = ((1.0, 100, 400),)
SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("steady", Verdict.HEALTHY, (), Phase(6, rate=6), Phase(6, rate=6)),
    Scenario("queueing", Verdict.QUEUEING, ("--max-num-seqs", "4"),
             Phase(6, users=3), Phase(6, users=12)),
    Scenario("decode_saturation", Verdict.DECODE_SATURATION, ("--peak-tflops", "8"),
             Phase(6, users=4, prompts=((1.0, 8, 24),), outputs=(32, 96)),
             Phase(6, users=32, prompts=((1.0, 8, 24),), outputs=(32, 96))),
    Scenario("out_of_capacity", Verdict.OUT_OF_CAPACITY,
             ("--peak-tflops", "8", "--max-num-seqs", "32"),
             Phase(6, users=4, prompts=((1.0, 8, 24),), outputs=(32, 96)),
             Phase(6, users=64, prompts=((1.0, 8, 24),), outputs=(32, 96))),
    Scenario("prefill_bound", Verdict.PREFILL_BOUND,
             ("--max-num-batched-tokens", "512", "--max-model-len", "8192"),
             Phase(6, rate=6), Phase(6, rate=6, prompts=((0.3, 100, 400), (0.7, 1500, 3000)))),
    Scenario("interference", Verdict.INTERFERENCE,
             ("--no-enable-chunked-prefill", "--max-model-len", "8192"),
             Phase(6, rate=6), Phase(6, rate=6, prompts=((0.6, 100, 400), (0.4, 2000, 4000)))),
    Scenario("kv_pressure", Verdict.KV_PRESSURE,
             ("--max-model-len", "2048", "--kv-cache-blocks", "256"),
             Phase(6, users=3, prompts=((1.0, 400, 800),), outputs=(32, 96)),
             Phase(6, users=16, prompts=((1.0, 400, 800),), outputs=(32, 96))),
)}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


class Staged(Protocol):
    """What `stacks` needs of a scenario: a name, the simulator's flags and time scale."""

    @property
    def name(self) -> str: ...
    @property
    def flags(self) -> tuple[str, ...]: ...
    @property
    def time_scale(self) -> float: ...


@dataclass
class Stack:
    """A simulator and a proxy in front of it."""

    scenario: Any  # a Scenario, or an onset scenario (benchmarks/diagnosis_onsets.py)
    sim_url: str  # the engine's URL: the simulator's, or a real vLLM's
    proxy_url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    model: str = MODEL  # the served model name requests carry


def _start(args: list[str], log: Path, env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=out)


def _started(url: str, proc: subprocess.Popen[bytes]) -> bool:
    """Whether the server answers; False if it exited first (say, its port was taken)."""
    try:
        wait_http(url, proc)
        return True
    except RuntimeError:
        if proc.poll() is None:
            raise
        return False


def start_proxy(upstream: str, workdir: Path, name: str,
                proxy_env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen[bytes]]:
    """`phasewatch serve` in front of `upstream` on a free port, its own SQLite file in
    `workdir`; returns its URL and process (not yet answering: see `wait_http`)."""
    port = free_port()
    env = {
        **os.environ,
        "PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{workdir}/{name}.db",
        "PHASEWATCH_WRITER_FLUSH_INTERVAL_S": "0.05",
        "PHASEWATCH_ENGINE_SCRAPE_INTERVAL_S": "0.5",
        "PHASEWATCH_DIAGNOSIS_INTERVAL_S": "0",
        "PHASEWATCH_LOG_LEVEL": "warning",
        # The benchmark reads /api on loopback: opened, as on a trusted network.
        "PHASEWATCH_ADMIN_OPEN": "true",
        **(proxy_env or {}),
    }
    return f"http://127.0.0.1:{port}", _start(
        ["-m", "phasewatch.cli", "serve", "--upstream", upstream, "--port", str(port)],
        workdir / f"{name}-proxy.log", env)


def start_sim(workdir: Path, name: str, flags: Sequence[str]
              ) -> tuple[str, subprocess.Popen[bytes]]:
    """`phasewatch sim` with `flags` on a free port, its log in `workdir`; returns its URL and
    process (not yet answering: see `wait_http`)."""
    port = free_port()
    return f"http://127.0.0.1:{port}", _start(
        ["-m", "phasewatch.sim", "--port", str(port), "--log-level", "warning", *flags],
        workdir / f"{name}-sim.log")


@contextmanager
def stacks(scenarios: Sequence[Staged], proxy_env: dict[str, str] | None = None
           ) -> Iterator[dict[str, Stack]]:
    """Start every scenario's simulator and proxy at once; stop them all afterwards. A server
    that exits before it answers (a port taken between choosing and binding it) is started
    again on another port, twice at most. `proxy_env` overrides the proxies' settings."""
    started: dict[str, Stack] = {}
    workdir = Path(tempfile.mkdtemp(prefix="pw-diag-"))

    def sim(s: Staged) -> tuple[str, subprocess.Popen[bytes]]:
        return start_sim(workdir, s.name, ("--time-scale", str(s.time_scale),
                                           "--served-model-name", MODEL, *s.flags))

    def proxy(s: Staged, upstream: str) -> tuple[str, subprocess.Popen[bytes]]:
        return start_proxy(upstream, workdir, s.name, proxy_env)

    try:
        for s in scenarios:
            sim_url, sim_proc = sim(s)
            proxy_url, proxy_proc = proxy(s, sim_url)
            started[s.name] = Stack(s, sim_url, proxy_url, [sim_proc, proxy_proc])
        for stack in started.values():
            s = stack.scenario
            for attempt in range(3):
                if _started(stack.sim_url + "/health", stack.procs[0]):
                    break
                if attempt == 2:
                    raise RuntimeError(f"the {s.name} simulator did not start: "
                                       + (workdir / f"{s.name}-sim.log").read_text()[-2000:])
                stack.sim_url, stack.procs[0] = sim(s)
                stack.procs[1].terminate()
                stack.procs[1].wait()
                stack.proxy_url, stack.procs[1] = proxy(s, stack.sim_url)
            for attempt in range(3):
                if _started(stack.proxy_url + "/api/health", stack.procs[1]):
                    break
                if attempt == 2:
                    raise RuntimeError(f"the {s.name} proxy did not start: "
                                       + (workdir / f"{s.name}-proxy.log").read_text()[-2000:])
                stack.proxy_url, stack.procs[1] = proxy(s, stack.sim_url)
        yield started
    finally:
        for stack in started.values():
            for proc in stack.procs:
                proc.terminate()
        for stack in started.values():
            for proc in stack.procs:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _draw_prompt(phase: Phase, rng: random.Random) -> int:
    pick = rng.random() * sum(w for w, _, _ in phase.prompts)
    for weight, low, high in phase.prompts:
        pick -= weight
        if pick <= 0:
            return rng.randint(low, high)
    return rng.randint(phase.prompts[-1][1], phase.prompts[-1][2])


async def _send(session: aiohttp.ClientSession, url: str, prompt_tokens: int,
                output_tokens: int, model: str = MODEL) -> bool:
    body = {"model": model, "prompt": "word " * prompt_tokens, "max_tokens": output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            data = await response.read()
            return response.status == 200 and b"[DONE]" in data[-64:]
    except (aiohttp.ClientError, TimeoutError):
        return False


@dataclass
class PhaseRun:
    start: datetime
    end: datetime
    sent: int = 0
    failed: int = 0


async def drive(session: aiohttp.ClientSession, url: str, phase: Phase, scale: float,
                rng: random.Random, model: str = MODEL) -> PhaseRun:
    """Send one phase's traffic; returns once every request it sent has ended."""
    run = PhaseRun(datetime.now(UTC), datetime.now(UTC))
    stop = time.monotonic() + phase.seconds * scale
    pending: list[asyncio.Task[bool]] = []

    def launch() -> asyncio.Task[bool]:
        run.sent += 1
        task = asyncio.create_task(_send(session, url, _draw_prompt(phase, rng),
                                         rng.randint(*phase.outputs), model))
        pending.append(task)
        return task

    if phase.rate is not None:
        # Arrivals on a fixed schedule (open loop): a late wake-up sends what is due at once,
        # so a busy machine delays requests but does not thin them out.
        due = time.monotonic()
        while True:
            due += rng.expovariate(phase.rate) * scale
            if due >= stop:
                await asyncio.sleep(max(0.0, stop - time.monotonic()))
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            launch()
    else:
        hard_stop = stop + 2 * phase.seconds * scale
        done = asyncio.Event()

        def going() -> bool:
            now = time.monotonic()
            return now < stop or (run.sent < phase.min_requests and now < hard_stop)

        async def user() -> None:
            await asyncio.sleep(rng.uniform(0, phase.think_s) * scale)
            while going():
                await launch()
                await asyncio.sleep(rng.uniform(0, phase.think_s) * scale)
            done.set()

        users = [asyncio.create_task(user()) for _ in range(phase.users or 1)]
        await done.wait()  # the first user to stop marks the phase's end
        run.end = datetime.now(UTC)
        await asyncio.gather(*users)
    if phase.rate is not None:
        run.end = datetime.now(UTC)
    results = await asyncio.gather(*pending)
    run.failed = sum(1 for ok in results if not ok)
    return run


def _z(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


async def _wait_stored(client: httpx.AsyncClient, since: datetime, count: int,
                       timeout_s: float = 20.0) -> None:
    """Until the proxy has stored `count` requests that arrived since `since`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        until = datetime.now(UTC) + timedelta(seconds=1)
        response = await client.get("/api/stats", params={
            "by": "none", "until": _z(until),
            "window": f"{(until - since).total_seconds():.3f}s"})
        groups = response.json()["groups"]
        if groups and groups[0]["requests"] >= count:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the proxy stored fewer than {count} requests within {timeout_s} s")


async def ask(client: httpx.AsyncClient, since: datetime, until: datetime,
              baseline: tuple[datetime, datetime]) -> dict[str, Any]:
    response = await client.get("/api/diagnosis", params={
        "model": MODEL, "until": _z(until),
        "window": f"{(until - since).total_seconds():.3f}s",
        "baseline": f"{_z(baseline[0])}/{_z(baseline[1])}",
    }, timeout=60)
    response.raise_for_status()
    return dict(response.json())


@dataclass
class Outcome:
    scenario: str
    expect: str
    verdict: str
    confidence: float
    summary: str
    baseline_requests: int
    window_requests: int
    report: dict[str, Any]
    # How far behind its model clock the simulator delivered (the machine's own load shows
    # here: a starved simulator stretches every latency it serves).
    sim_late_steps: int = 0
    sim_late_max_ms: float = 0.0

    @property
    def right(self) -> bool:
        return self.verdict == self.expect


async def run_scenario(stack: Stack, seed: int, steady_windows: int = 0) -> list[Outcome]:
    """Baseline phase, window phase, one diagnosis. With `steady_windows`, instead one long
    run of the baseline's traffic judged window by window: each window (the window phase's
    length, overlapping the previous by half) against the baseline phase's length before it."""
    s: Scenario = stack.scenario
    rng = random.Random(seed)
    scale = s.time_scale
    async with (aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512),
                                      timeout=aiohttp.ClientTimeout(total=300)) as session,
                httpx.AsyncClient(base_url=stack.proxy_url) as client):
        await _send(session, stack.proxy_url, 16, 4)  # warm-up, before any phase
        if steady_windows:
            long = Phase(s.baseline.seconds + s.window.seconds * (steady_windows + 1) / 2 + 1,
                         rate=s.baseline.rate, users=s.baseline.users,
                         prompts=s.baseline.prompts, outputs=s.baseline.outputs)
            run = await drive(session, stack.proxy_url, long, scale, rng)
            await _wait_stored(client, run.start, run.sent)
            first = run.start + timedelta(seconds=s.baseline.seconds * scale)
            step = timedelta(seconds=s.window.seconds * scale / 2)
            outcomes = []
            for k in range(steady_windows):
                since = first + k * step
                until = since + timedelta(seconds=s.window.seconds * scale)
                if until > run.end:
                    break
                prior = (since - timedelta(seconds=s.baseline.seconds * scale), since)
                outcomes.append(_outcome(s, await ask(client, since, until, prior)))
            return outcomes
        before = await _lateness(stack)
        base = await drive(session, stack.proxy_url, s.baseline, scale, rng)
        window = await drive(session, stack.proxy_url, s.window, scale, rng)
        await _wait_stored(client, base.start, base.sent + window.sent)
        since = window.start + timedelta(seconds=s.settle_s * scale)
        report = await ask(client, since, window.end, (base.start, base.end))
        after = await _lateness(stack)
        outcome = _outcome(s, report)
        outcome.sim_late_steps = int(after[0] - before[0])
        outcome.sim_late_max_ms = after[1]
        return [outcome]


async def _lateness(stack: Stack) -> tuple[float, float]:
    """The simulator's steps delivered over 1 ms late so far, and the worst lateness (ms)."""
    async with httpx.AsyncClient() as client:
        late = (await client.get(stack.sim_url + "/sim/state")).json()["lateness"]
    return float(late["late_steps_over_1ms"]), float(late["max_ms"])


def _outcome(s: Scenario, report: dict[str, Any]) -> Outcome:
    samples = report["evidence"]["samples"]
    return Outcome(s.name, s.expect.value, report["verdict"], report["confidence"],
                   report["summary"], samples["baseline"]["requests"],
                   samples["window"]["requests"], report)


def confusion(outcomes: list[Outcome]) -> str:
    """Rows: the expected verdict; columns: the verdict given."""
    verdicts = [v.value for v in Verdict]
    counts = Counter((o.expect, o.verdict) for o in outcomes)
    rows = sorted({o.expect for o in outcomes}, key=verdicts.index)
    cols = [v for v in verdicts if any(o.verdict == v for o in outcomes) or v in rows]
    width = max(len(c) for c in cols) + 1
    lines = ["expected \\ given".ljust(20) + "".join(c[:width].rjust(width) for c in cols)]
    for r in rows:
        lines.append(r.ljust(20) + "".join(str(counts[(r, c)]).rjust(width) for c in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--steady-windows", type=int, default=20,
                        help="windows judged over the long steady run (0: none)")
    parser.add_argument("--quick", action="store_true", help="one repeat, no long run")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steady_windows = 1, 0
    chosen = [SCENARIOS[name] for name in (args.scenario or list(SCENARIOS))]
    outcomes: list[Outcome] = []
    steady: list[Outcome] = []
    started = time.monotonic()
    with stacks(chosen) as running:
        for repeat in range(args.repeats):
            for s in chosen:
                got = asyncio.run(run_scenario(running[s.name], seed=1000 * repeat + 7))
                outcomes.extend(got)
                for o in got:
                    print(f"[{repeat}] {o.scenario:18s} -> {o.verdict:18s} "
                          f"{'ok ' if o.right else 'BAD'} conf {o.confidence:.2f} "
                          f"(n {o.baseline_requests}/{o.window_requests}, sim late steps "
                          f"{o.sim_late_steps}) {o.summary[:140]}",
                          flush=True)
        if args.steady_windows and "steady" in running:
            steady = asyncio.run(run_scenario(running["steady"], seed=99,
                                              steady_windows=args.steady_windows))
    print("\nconfusion matrix (rows expected, columns given), "
          f"{args.repeats} repeat(s):\n" + confusion(outcomes))
    right = sum(o.right for o in outcomes)
    print(f"right: {right} of {len(outcomes)}")
    if steady:
        alarms = [o for o in steady if o.verdict != Verdict.HEALTHY.value]
        print(f"long steady run: {len(alarms)} false alarm(s) in {len(steady)} windows "
              f"({Counter(o.verdict for o in steady)})")
    print(f"took {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "outcomes": [o.__dict__ for o in outcomes],
            "steady": [o.__dict__ for o in steady],
            "confusion": confusion(outcomes),
        }, indent=2))
    return 0 if right == len(outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
