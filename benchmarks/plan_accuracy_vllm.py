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

The error is predicted / measured - 1. Everything (engine, proxy, clients) shares this
machine's cores, so the engine's step time at 16 users includes contention the model does not
know about; the figure is the whole system's, as an operator on such a machine would see it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
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
            load.gaps.extend(b - a for a, b in itertools.pairwise(stamps))


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


def accuracy(calibrate_users: int = 2, predict_users: tuple[int, ...] = (8, 16),
             seconds: float = 90.0, warmup: float = 15.0) -> list[dict[str, Any]]:
    """Rows as plan_accuracy.py prints them: one per predicted load."""
    from tests.vllm.server import locate, running_vllm  # the benchmark's only use of tests/

    env = locate()
    if not env.ready:
        raise SystemExit("the vLLM test environment is not built: run `make vllm-env`")
    with tempfile.TemporaryDirectory(prefix="plan-vllm-") as tmp:
        workdir = Path(tmp)
        flags = ("--max-num-seqs", str(CAP), "--max-num-batched-tokens", str(BUDGET))
        with running_vllm(env, workdir, served_model_name=MODEL, engine_args=flags) as vllm:
            proxy, proc = start_proxy(vllm.url, workdir, "plan")
            try:
                wait_http(proxy + "/api/health", proc)
                database_url = f"sqlite+aiosqlite:///{workdir}/plan.db"
                calibration = asyncio.run(run_load(
                    proxy, "calibrate", Load(calibrate_users, 2 * seconds, warmup)))
                _stored(proxy, calibration.requests)
                predicted = {users: plan(database_url, "calibrate", users)
                             for users in predict_users}
                sent = calibration.requests
                rows = []
                for users in predict_users:
                    load = asyncio.run(run_load(proxy, f"users-{users}",
                                                Load(users, seconds, warmup)))
                    sent += load.requests
                    got = predicted[users]["predicted"]
                    guess = (got["ttft_p95_s"], got["itl_p50_s"], got["itl_p95_s"])
                    truth = load.figures()
                    rows.append({
                        "gpu": "vllm-cpu", "model": MODEL,
                        "case": f"{users // calibrate_users}x users ({users} users, cap {CAP})",
                        "users": users, "max_num_seqs": CAP,
                        "measured_requests": len(load.ttft),
                        "measured_ms": dict(zip(FIGURES, (v * 1e3 for v in truth),
                                                strict=True)),
                        "predicted_ms": dict(zip(FIGURES, (v * 1e3 for v in guess),
                                                 strict=True)),
                        "error": dict(zip(FIGURES, (p / t - 1 for p, t in zip(
                            guess, truth, strict=True)), strict=True)),
                        "refused": predicted[users]["calibration"]["refused"],
                        "extrapolated": predicted[users].get("extrapolated"),
                        "calibration_requests": calibration.requests,
                        "calibration_measured_ms": dict(zip(
                            FIGURES, (v * 1e3 for v in calibration.figures()), strict=True)),
                    })
                _stored(proxy, sent)
            finally:
                proc.terminate()
                proc.wait(timeout=15)
    return rows
