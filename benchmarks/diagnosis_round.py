"""CPU of the diagnosis's pure core for one round: `diagnose()` over a window, a baseline and
requests in flight of the sizes a busy model's round reads (by default 3,000, 3,000 and
1,000: `PHASEWATCH_DIAGNOSIS_MAX_SAMPLES` a side), with the engine's signals. This is the part
of a round that runs in a thread sharing the GIL with the relay; the database reads around it
are `benchmarks/store_scale.py diagnosis`.

The samples are synthetic and seeded: a window whose TTFT and ITL rose against the baseline
(so every comparison runs, the prompt-length adjustment and the bootstrap included). It
prints the median CPU time per round over `--repeats` rounds after one warm-up, and with
`--baseline-python PYTHON` (another checkout's interpreter, e.g. a worktree of the previous
commit with its own install) the same measured there in the same run, alternating, and the
ratio.

Run: `.venv/bin/python benchmarks/diagnosis_round.py [--repeats 30] [--baseline-python
/tmp/base/.venv/bin/python] [--json out.json]`; `--quick` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from phasewatch.core.live import InFlight
from phasewatch.diagnosis.diagnose import Rules, diagnose
from phasewatch.diagnosis.observations import Observation, Sample
from phasewatch.engine.window import EngineWindow


def observations(rng: random.Random, n: int, start_s: float, span_s: float, ttft_scale: float,
                 itl_scale: float) -> list[Observation]:
    out = []
    for i in range(n):
        prompt = rng.choice((64, 128, 256, 512, 1024, 2048))
        ttft = ttft_scale * (0.02 + prompt / 40_000) * rng.lognormvariate(0, 0.3)
        itl = itl_scale * 0.01 * rng.lognormvariate(0, 0.15)
        out.append(Observation(
            started_s=start_s + span_s * i / n, ok=True, ttft_s=ttft, e2e_s=ttft + 127 * itl,
            itl_count=127, itl_p50_s=itl, itl_max_s=itl * 3, prompt_tokens=prompt,
            in_flight=rng.randint(0, 64)))
    return out


def in_flight(rng: random.Random, n: int, now_s: float) -> list[InFlight]:
    out = []
    for _ in range(n):
        age = rng.uniform(0.0, 3.0)
        waiting = rng.random() < 0.2
        out.append(InFlight(
            model="m", started_s=now_s - age, age_s=age, ttft_s=None if waiting else age / 4,
            silent_s=0.01, itl_count=0 if waiting else 40,
            itl_p50_s=None if waiting else 0.02 * rng.lognormvariate(0, 0.1),
            itl_max_s=None if waiting else 0.06, prompt_tokens=256, in_flight=64))
    return out


def samples(window_n: int, baseline_n: int, live_n: int) -> tuple[Sample, Sample]:
    rng = random.Random(7)
    now = 1_800_000_000.0
    base = observations(rng, baseline_n, now - 3900, 3600, 1.0, 1.0)
    win = observations(rng, window_n, now - 300, 300, 2.5, 1.8)
    return (Sample(win, 300.0, window_n, in_flight(rng, live_n, now)),
            Sample(base, 3600.0, baseline_n))


def engine() -> EngineWindow:
    return EngineWindow(scrapes=30, running_mean=48.0, running_max=64.0, waiting_mean=6.0,
                        waiting_max=20.0, queue_time_mean_s=0.4)


def measure(repeats: int, window_n: int, baseline_n: int, live_n: int) -> list[float]:
    window, baseline = samples(window_n, baseline_n, live_n)
    signals, rules = engine(), Rules()
    diagnose(window, baseline, signals, rules)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        diagnose(window, baseline, signals, rules)
        times.append((time.process_time() - t0) * 1e3)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--window", type=int, default=3000)
    p.add_argument("--baseline", type=int, default=3000)
    p.add_argument("--in-flight", type=int, default=1000)
    p.add_argument("--baseline-python", help="another checkout's interpreter, measured beside")
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="a smoke run: small samples, 5 rounds")
    p.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)  # one side's times
    args = p.parse_args()
    if args.quick:
        args.repeats, args.window, args.baseline, args.in_flight = 5, 200, 200, 50
    sizes = (args.window, args.baseline, args.in_flight)
    if args.raw:
        print(json.dumps(measure(args.repeats, *sizes)))
        return 0
    sides: dict[str, list[float]] = {"this checkout": []}
    if args.baseline_python:
        sides["baseline"] = []
    # Alternate the sides in rounds of five, so the machine's drift falls on both.
    for _ in range(max(1, args.repeats // 5)):
        for side, times in sides.items():
            python = sys.executable if side == "this checkout" else args.baseline_python
            out = subprocess.run(
                [python, __file__, "--raw", "--repeats", "5", "--window", str(sizes[0]),
                 "--baseline", str(sizes[1]), "--in-flight", str(sizes[2])],
                capture_output=True, text=True, check=True, cwd="/")
            times.extend(json.loads(out.stdout))
    result: dict[str, Any] = {"sizes": dict(zip(("window", "baseline", "in_flight"), sizes,
                                                 strict=True))}
    for side, times in sides.items():
        result[side] = {"median_ms": statistics.median(times), "rounds": len(times)}
        print(f"{side:14s} CPU per round: median {statistics.median(times):6.1f} ms "
              f"(min {min(times):.1f}, max {max(times):.1f}, {len(times)} rounds)")
    if "baseline" in sides:
        ratio = result["this checkout"]["median_ms"] / result["baseline"]["median_ms"]
        result["ratio"] = ratio
        print(f"this checkout / baseline: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
