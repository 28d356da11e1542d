"""SLO headroom: the highest request rate a calibrated deployment serves within both SLOs,
found by bisection over `whatif.predict` (Poisson arrivals, lengths as observed).

Invariants: pure and deterministic; a rate "meets" when both the share of requests within the
TTFT threshold and the share of token gaps within the ITL threshold reach the objective;
meeting is taken as monotone in the rate (more load never helps). `compute` is the whole job
from stored rows, a top-level function so a worker process can run it (capacity.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phasewatch.plan.fit import CannotCalibrate, calibrate
from phasewatch.plan.refine import refine
from phasewatch.plan.traffic import Request
from phasewatch.plan.whatif import Lengths, Limits, Workload, predict

LOWEST_RPS = 0.01
HIGHEST_RPS = 10_000.0
BISECTIONS = 10
REQUESTS = 600  # simulated per rate


def meets(calibration: Any, limits: Limits, lengths: Lengths, rate: float, *, slo_ttft_s: float,
          slo_itl_s: float, objective: float) -> bool:
    workload = Workload(lengths, rate_rps=rate, requests=REQUESTS)
    return predict(calibration, limits, workload, slo_ttft_s=slo_ttft_s,
                   slo_itl_s=slo_itl_s).meets(objective)


def max_rate(calibration: Any, limits: Limits, lengths: Lengths, *, slo_ttft_s: float,
             slo_itl_s: float, objective: float) -> float:
    """The highest rate (requests/s, to about 7%) that meets both objectives; 0.0 when even
    `LOWEST_RPS` does not (a request alone misses one)."""
    slo = {"slo_ttft_s": slo_ttft_s, "slo_itl_s": slo_itl_s, "objective": objective}
    if not meets(calibration, limits, lengths, LOWEST_RPS, **slo):
        return 0.0
    low, high = LOWEST_RPS, 1.0
    while high < HIGHEST_RPS and meets(calibration, limits, lengths, high, **slo):
        low, high = high, high * 4
    for _ in range(BISECTIONS):
        mid = (low * high) ** 0.5
        if meets(calibration, limits, lengths, mid, **slo):
            low = mid
        else:
            high = mid
    return low


def compute(rows: Sequence[tuple[Any, ...]], max_num_seqs: int, max_num_batched_tokens: int,
            slo_ttft_s: float, slo_itl_s: float, objective: float) -> float | None:
    """The highest rate within both SLOs for the stored rows (`plan_inputs.PLAN_COLUMNS`), or
    None when they cannot calibrate."""
    requests = [Request(*row) for row in rows]
    limits = Limits(max_num_seqs, max_num_batched_tokens)
    try:
        calibration = refine(calibrate(requests, max_num_seqs), limits, requests)
    except CannotCalibrate:
        return None
    lengths = Lengths([r.prompt_tokens for r in requests], [r.output_tokens for r in requests])
    return max_rate(calibration, limits, lengths, slo_ttft_s=slo_ttft_s, slo_itl_s=slo_itl_s,
                    objective=objective)
