"""Accuracy of `phasewatch plan` on the simulator: calibrate on one load, predict others, and
hold each prediction to what the simulator's engine then does at that load.

For each GPU and model preset, closed-loop traffic at `--users` (with prompts of 128-1,024
tokens and outputs of 64-256) is replayed through the simulator's own scheduler and cost
model, and stored as the proxy would store it (arrival, TTFT, end, token counts, median gap).
`phasewatch plan`'s calibration (phasewatch.plan.fit, refine) reads that, then predicts TTFT
p95 and ITL p50 and p95 at 0.5x, 2x and 4x the users, and at 2x the users with
`--max-num-seqs` halved (so the cap binds and requests queue); the same loads are then run
through the simulator's engine. It prints the relative error of every prediction
(predicted / measured - 1) and whether it is within `--tolerance`.

No server runs: the simulator's engine is replayed without a clock (phasewatch.plan.whatif
`replay`), which is what its server runs in real time.

`--vllm`: the same question on the real vLLM of tests/vllm, through the proxy and
`phasewatch plan` as an operator runs them: calibrate at 2 users, predict 8 and 16, then run
them (benchmarks/plan_accuracy_vllm.py; about 7 minutes; tolerance 25%). Each row also gives
the calibrated engine's TTFT p95 on the arrivals the proxy stored for that load: the engine
model's own error, apart from the what-if's closed-loop users. `--keep DIR` keeps the run's
database and the clients' samples (`python -m benchmarks.plan_accuracy_vllm DIR` scores them
again, without vLLM).

Run: `.venv/bin/python benchmarks/plan_accuracy.py [--users 8] [--tolerance 0.15] [--json
out.json]`; `--quick`: one preset; `--vllm`: the real vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from phasewatch.plan.fit import calibrate
from phasewatch.plan.refine import refine
from phasewatch.plan.whatif import Lengths, Limits, Workload, predict, replay
from phasewatch.sim.config import SimConfigError, SimSettings, resolve
from phasewatch.sim.costmodel import CostModel

LENGTHS = Lengths([128, 256, 512, 1024], [64, 128, 256])
PRESETS = [(gpu, model) for gpu in ("t4", "a100", "h100", "h200")
           for model in ("qwen2.5-0.5b", "llama-3.1-8b")]
FIGURES = ("ttft_p95", "itl_p50", "itl_p95")


def _rank(values: np.ndarray, q: float) -> float:
    ordered = np.sort(values)
    return float(ordered[max(0, math.ceil(q * ordered.size) - 1)])


def measure(cost: CostModel, overhead: float, limits: Limits,
            workload: Workload) -> tuple[float, float, float]:
    done = replay(cost, overhead, limits, workload, seed=5)
    counted = sorted(done.arrival)[int(len(done.arrival) * 0.2):]
    ttft = np.array([done.tokens[n][0] - done.arrival[n] for n in counted])
    gaps = np.concatenate([np.diff(done.tokens[n]) for n in counted])
    return _rank(ttft, 0.95), _rank(gaps, 0.5), _rank(gaps, 0.95)


def preset(gpu: str, model: str, users: int, requests: int) -> list[dict[str, Any]] | None:
    try:
        config = resolve(SimSettings(gpu=gpu, model=model))
    except SimConfigError:
        return None  # the model does not fit this GPU
    cost, overhead = config.cost_model, config.request_overhead_s
    cap = 2 * users  # the engine's cap while calibrating: not binding

    def limits(max_num_seqs: int) -> Limits:
        return Limits(max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill)

    seen = replay(cost, overhead, limits(cap),
                  Workload(LENGTHS, concurrency=users, requests=requests), seed=1).requests()
    calibration = refine(calibrate(seen, cap), limits(cap), seen)
    rows = []
    for label, load, max_num_seqs in (
            ("0.5x users", max(1, users // 2), cap), ("2x users", 2 * users, cap),
            ("4x users", 4 * users, 4 * users), ("2x users, max-num-seqs halved",
                                                 2 * users, max(1, users // 2))):
        workload = Workload(LENGTHS, concurrency=load, requests=requests)
        truth = measure(cost, overhead, limits(max_num_seqs), workload)
        got = predict(calibration, limits(max_num_seqs), workload, slo_ttft_s=0.5,
                      slo_itl_s=0.04, seed=5)
        predicted = (got.ttft_p95_s, got.itl_p50_s, got.itl_p95_s)
        rows.append({"gpu": gpu, "model": model, "case": label, "users": load,
                     "max_num_seqs": max_num_seqs,
                     "measured_ms": dict(zip(FIGURES, (v * 1e3 for v in truth), strict=True)),
                     "predicted_ms": dict(zip(FIGURES, (v * 1e3 for v in predicted),
                                              strict=True)),
                     "error": dict(zip(FIGURES, (p / t - 1 for p, t in zip(predicted, truth,
                                                                           strict=True)),
                                       strict=True)),
                     "refused": sorted(calibration.refused)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=8, help="the calibration's closed-loop users")
    p.add_argument("--requests", type=int, default=600, help="requests per replay")
    p.add_argument("--tolerance", type=float, default=None,
                   help="default 0.15 on the simulator, 0.25 on vLLM")
    p.add_argument("--vllm", action="store_true",
                   help="the real vLLM of tests/vllm: calibrate at 2 users, predict 8 and 16")
    p.add_argument("--seconds", type=float, default=90.0,
                   help="--vllm: seconds per predicted load (calibration: twice that)")
    p.add_argument("--keep", type=Path, default=None,
                   help="--vllm: keep the proxy's database and the clients' samples here")
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="one preset, fewer requests")
    args = p.parse_args()
    if args.tolerance is None:
        args.tolerance = 0.25 if args.vllm else 0.15
    presets = PRESETS[2:3] if args.quick else PRESETS
    requests = 300 if args.quick else args.requests
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    found_by_preset: list[tuple[str, str, list[dict[str, Any]] | None]]
    if args.vllm:
        repo = str(Path(__file__).resolve().parents[1])
        if repo not in sys.path:  # run as a script: `benchmarks` is a package of the checkout
            sys.path.insert(0, repo)
        from benchmarks.plan_accuracy_vllm import MODEL, accuracy
        found_by_preset = [("vllm-cpu", MODEL, accuracy(seconds=args.seconds, keep=args.keep))]
    else:
        found_by_preset = [(gpu, model, preset(gpu, model, args.users, requests))
                           for gpu, model in presets]
    print(f"{'gpu':8s} {'model':13s} {'case':31s} " + " ".join(f"{f:>9s}" for f in FIGURES))
    for gpu, model, found in found_by_preset:
        if found is None:
            print(f"{gpu:8s} {model:13s} (the model does not fit this GPU)")
            continue
        for row in found:
            rows.append(row)
            cells = " ".join(
                f"{row['error'][f]:+8.0%}{' ' if abs(row['error'][f]) <= args.tolerance else '!'}"
                for f in FIGURES)
            alone = row.get("engine_alone")  # --vllm: the engine on the stored arrivals
            extra = (f"   engine alone on the stored arrivals: TTFT p95 {alone['error']:+.0%}"
                     if alone else "")
            print(f"{gpu:8s} {model:13s} {row['case']:31s} {cells}{extra}")
    within = sum(abs(row["error"][f]) <= args.tolerance for row in rows for f in FIGURES)
    total = len(rows) * len(FIGURES)
    print(f"within {args.tolerance:.0%}: {within} of {total} ('!' marks the others); "
          f"took {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"tolerance": args.tolerance, "within": within,
                                         "total": total, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
