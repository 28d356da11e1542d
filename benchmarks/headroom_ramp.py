"""How long before a burn alert the SLO headroom falls below 1, on a slow ramp of traffic.

The simulator (`--gpu`, `--model`, `--max-num-seqs`), `phasewatch serve` in front of it with
the headroom duty on (PHASEWATCH_CAPACITY_INTERVAL_S, the engine's limits given), and
Prometheus scraping the proxy every `--scrape-s` with deploy/rules as shipped (the SLO burn
alerts of deploy/slo.yaml, evaluated every `--scrape-s`). Open-loop Poisson arrivals of
streamed completions (prompts of 128-1,024 words, outputs of 64-256 tokens):

1. warm: `--warm-rate` requests/s for `--warm-s` (traffic for the duty's first calibrations);
2. ramp: the rate rises linearly, from the warm rate to `--ramp-to` times the highest rate
   within both SLOs the duty exported last in the warm-up (`phasewatch_slo_max_rate_rps`),
   over `--ramp-s`;
3. hold at that rate until a burn alert fires, or for `--hold-s`.

Every second it reads the proxy's `phasewatch_slo_headroom` and Prometheus's alerts, and it
prints when the headroom first fell below 1, when a TTFT or ITL burn alert was first pending
(its condition true) and when it first fired (after its `for:`), and the leads over the
headroom. Target (docs/plan.md): the headroom below 1 at least 60 s before a burn alert fires.

Prometheus starts with the run, so its long windows (1h, 6h, ...) hold only the run's data;
a deployment with hours of healthy history behind it fires later, not sooner.

Run: `.venv/bin/python benchmarks/headroom_ramp.py [--json out.json]` (about 12 minutes; exit
1 when the target is missed); `--quick`: 40 s end to end, no target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: `benchmarks` is a package of the checkout
    sys.path.insert(0, str(REPO))

from benchmarks.diagnosis_scenarios import (  # noqa: E402
    free_port,
    start_proxy,
    start_sim,
    wait_http,
)

BURN_ALERTS = frozenset({"PhasewatchTTFTBudgetBurn", "PhasewatchITLBudgetBurn"})
PROMPT_WORDS = (128, 256, 512, 1024)
OUTPUT_TOKENS = (64, 128, 256)


@dataclass
class Marks:
    """Seconds from the start of the ramp."""

    started: float = 0.0  # monotonic: the ramp's start
    headroom_below_1: float | None = None
    pending: float | None = None
    firing: float | None = None
    alert: str = ""
    headroom: list[tuple[float, float]] = field(default_factory=list)  # (s, headroom)
    rate: list[tuple[float, float]] = field(default_factory=list)  # (s, offered rate)

    def at(self) -> float:
        return round(time.monotonic() - self.started, 1)


def _gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def _request(session: aiohttp.ClientSession, url: str, model: str,
                   rng: random.Random, failed: list[int]) -> None:
    body = {"model": model, "prompt": "word " * rng.choice(PROMPT_WORDS),
            "max_tokens": rng.choice(OUTPUT_TOKENS), "ignore_eos": True, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            async for _ in response.content.iter_any():
                pass
            if response.status != 200:
                failed[0] += 1
    except aiohttp.ClientError:
        failed[0] += 1


async def _arrivals(url: str, model: str, rate_at: Any, until: Any, marks: Marks,
                    seed: int) -> int:
    """Poisson arrivals at `rate_at(elapsed)` (thinning) until `until()`; returns failures."""
    rng = random.Random(seed)
    failed = [0]
    tasks: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=1800)) as session:
        peak = max(rate_at(s) for s in range(0, 4000))
        while not until():
            await asyncio.sleep(rng.expovariate(peak))
            if rng.random() * peak <= rate_at(time.monotonic() - marks.started):
                task = asyncio.create_task(_request(session, url, model, rng, failed))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return failed[0]


async def _watch(proxy: str, prometheus: str, marks: Marks, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            now = marks.at()
            try:
                headroom = _gauge((await client.get(proxy + "/metrics")).text,
                                  "phasewatch_slo_headroom")
                alerts = (await client.get(prometheus + "/api/v1/alerts")).json()["data"]
            except httpx.HTTPError:
                headroom, alerts = None, {"alerts": []}
            if headroom is not None:
                marks.headroom.append((now, headroom))
                if headroom < 1 and marks.headroom_below_1 is None and now >= 0:
                    marks.headroom_below_1 = now
            for alert in alerts["alerts"]:
                name = alert["labels"]["alertname"]
                if name not in BURN_ALERTS:
                    continue
                if marks.pending is None:
                    marks.pending = now
                if alert["state"] == "firing" and marks.firing is None:
                    marks.firing, marks.alert = now, f"{name} ({alert['labels'].get('severity')})"
                    stop.set()
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass


def _prometheus(port: int, proxy_port: int, scrape_s: float, workdir: Path
                ) -> subprocess.Popen[bytes]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus is not installed (Debian's `prometheus` package)")
    config = {"global": {"scrape_interval": f"{scrape_s:g}s",
                         "evaluation_interval": f"{scrape_s:g}s"},
              "rule_files": [str(REPO / "deploy" / "rules" / "*.yml")],
              "scrape_configs": [{"job_name": "phasewatch", "static_configs": [
                  {"targets": [f"127.0.0.1:{proxy_port}"]}]}]}
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    with (workdir / "prometheus.log").open("wb") as log:
        return subprocess.Popen(
            [binary, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)


async def _run(args: argparse.Namespace, proxy: str, prometheus: str, model: str
               ) -> tuple[Marks, float, int]:
    marks = Marks(started=time.monotonic() + args.warm_s)
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(proxy, prometheus, marks, stop))
    warm_end = time.monotonic() + args.warm_s
    failed = await _arrivals(proxy, model, lambda s: args.warm_rate,
                             lambda: time.monotonic() >= warm_end, marks, args.seed)
    async with httpx.AsyncClient(timeout=5) as client:
        top = _gauge((await client.get(proxy + "/metrics")).text, "phasewatch_slo_max_rate_rps")
    if top is None:
        stop.set()
        await watcher
        raise SystemExit(f"no headroom was exported in the {args.warm_s:g} s warm-up "
                         f"(PHASEWATCH_CAPACITY_INTERVAL_S {args.capacity_interval_s:g})")
    peak: float = args.ramp_to * top
    low: float = args.warm_rate
    ramp_s: float = args.ramp_s
    marks.started = time.monotonic()

    def rate_at(s: float) -> float:
        return low + (peak - low) * min(1.0, max(0.0, s) / ramp_s)

    end = marks.started + args.ramp_s + args.hold_s
    failed += await _arrivals(proxy, model, rate_at,
                              lambda: stop.is_set() or time.monotonic() >= end, marks,
                              args.seed + 1)
    stop.set()
    await watcher
    return marks, top, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="a100")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--warm-rate", type=float, default=0.5, help="requests/s (default 0.5)")
    p.add_argument("--warm-s", type=float, default=150.0)
    p.add_argument("--ramp-to", type=float, default=2.0,
                   help="the ramp's end, times the highest rate within both SLOs (default 2)")
    p.add_argument("--ramp-s", type=float, default=360.0)
    p.add_argument("--hold-s", type=float, default=600.0)
    p.add_argument("--capacity-interval-s", type=float, default=15.0)
    p.add_argument("--scrape-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true",
                   help="a short run end to end (no alert can fire in it: no target)")
    args = p.parse_args(argv)
    if args.quick:
        args.warm_rate, args.warm_s, args.ramp_s, args.hold_s = 3.0, 25.0, 10.0, 0.0
        args.capacity_interval_s, args.scrape_s = 2.0, 1.0

    with tempfile.TemporaryDirectory(prefix="headroom-ramp-") as tmp:
        workdir = Path(tmp)
        prometheus_port = free_port()
        sim_url, sim = start_sim(workdir, "ramp", ("--gpu", args.gpu, "--model", args.model,
                                                    "--max-num-seqs", str(args.max_num_seqs)))
        procs = [sim]
        try:
            wait_http(sim_url + "/health", sim)
            state = httpx.get(sim_url + "/sim/state").json()
            budget = state["config"]["max_num_batched_tokens"]
            proxy, proc = start_proxy(sim_url, workdir, "ramp", {
                "PHASEWATCH_CAPACITY_INTERVAL_S": f"{args.capacity_interval_s:g}",
                "PHASEWATCH_CAPACITY_MAX_NUM_SEQS": str(args.max_num_seqs),
                "PHASEWATCH_CAPACITY_MAX_NUM_BATCHED_TOKENS": str(budget),
                "PHASEWATCH_DIAGNOSIS_INTERVAL_S": "30"})
            procs.append(proc)
            wait_http(proxy + "/api/health", proc)
            prometheus_proc = _prometheus(prometheus_port, int(proxy.rsplit(":", 1)[1]),
                                          args.scrape_s, workdir)
            procs.append(prometheus_proc)
            prometheus = f"http://127.0.0.1:{prometheus_port}"
            wait_http(prometheus + "/-/ready", prometheus_proc)
            model = httpx.get(proxy + "/v1/models").json()["data"][0]["id"]
            print(f"headroom ramp: {args.gpu} {args.model}, max-num-seqs "
                  f"{args.max_num_seqs}, budget {budget}; warm {args.warm_rate:g}/s for "
                  f"{args.warm_s:g} s, then to {args.ramp_to:g}x the highest rate over "
                  f"{args.ramp_s:g} s; headroom every {args.capacity_interval_s:g} s, "
                  f"Prometheus every {args.scrape_s:g} s", flush=True)
            marks, top, failed = asyncio.run(_run(args, proxy, prometheus, model))
        finally:
            for proc in reversed(procs):
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()

    lead_fire = (None if marks.firing is None or marks.headroom_below_1 is None
                 else round(marks.firing - marks.headroom_below_1, 1))
    lead_pending = (None if marks.pending is None or marks.headroom_below_1 is None
                    else round(marks.pending - marks.headroom_below_1, 1))
    print(f"highest rate within both SLOs at the ramp's start: {top:.2f}/s (ramp to "
          f"{args.ramp_to * top:.2f}/s); failed requests: {failed}")
    print(f"headroom below 1 at {marks.headroom_below_1} s into the ramp; burn alert pending "
          f"at {marks.pending} s, firing at {marks.firing} s ({marks.alert or 'none'})")
    print(f"lead over firing: {lead_fire} s; over pending: {lead_pending} s "
          f"(target: firing >= 60 s after the headroom fell below 1)")
    if args.json:
        args.json.write_text(json.dumps({
            "args": vars(args) | {"json": str(args.json)}, "top_rps": top, "failed": failed,
            "headroom_below_1_s": marks.headroom_below_1, "pending_s": marks.pending,
            "firing_s": marks.firing, "alert": marks.alert, "lead_firing_s": lead_fire,
            "lead_pending_s": lead_pending, "headroom": marks.headroom}, indent=2))
    return 0 if args.quick or (lead_fire is not None and lead_fire >= 60) else 1


if __name__ == "__main__":
    sys.exit(main())
