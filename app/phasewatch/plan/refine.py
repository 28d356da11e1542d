"""The compute side of a calibration, refined by replaying the observed arrivals through the
scheduler: the prefill cost per token, the share of the step's fixed cost that compute-bound
steps pay too, and the request overhead, that make the simulated TTFTs closest to the
observed ones (median relative error).

fit.py's estimate of `per_token_s` reads each TTFT as the request's own prefill; under load
several prompts share a step and some queue, which only a replay of the same arrivals through
the same scheduler reproduces. Invariant: pure and deterministic; the memory side of the
calibration is left as fit.py found it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from phasewatch.plan.fit import Calibration
from phasewatch.plan.traffic import Request
from phasewatch.plan.whatif import Limits, replay_observed

# Golden-section steps over log(per_token_s), within a factor `SPAN` of fit.py's estimate,
# for each share of base_s tried as the fixed cost of every step.
STEPS = 12
FIXED_SHARES = (0.0, 0.5, 0.9)
SPAN = 4.0
# At most this many requests are replayed per evaluation (the latest, contiguous).
MAX_REPLAYED = 1500


def _error(calibration: Calibration, limits: Limits, arrivals: Sequence[tuple[float, int, int]],
           observed: np.ndarray) -> tuple[float, float]:
    """(median relative TTFT error, the overhead that gives it) for this per-token cost."""
    simulated = np.asarray(replay_observed(replace(calibration, overhead_s=0.0), limits,
                                           arrivals))
    overhead = max(0.0, float(np.median(observed - simulated)))
    return float(np.median(np.abs(simulated + overhead - observed) / observed)), overhead


def _search(calibration: Calibration, limits: Limits,
            arrivals: Sequence[tuple[float, int, int]],
            observed: np.ndarray) -> tuple[float, float, float]:
    """(error, per_token_s, overhead_s) at the best per-token cost for this calibration."""
    ratio = (math.sqrt(5) - 1) / 2
    low = math.log(calibration.per_token_s / SPAN)
    high = math.log(calibration.per_token_s * SPAN)
    cache: dict[float, tuple[float, float]] = {}

    def at(x: float) -> tuple[float, float]:
        if x not in cache:
            cache[x] = _error(replace(calibration, per_token_s=math.exp(x)), limits, arrivals,
                              observed)
        return cache[x]

    a, b = high - ratio * (high - low), low + ratio * (high - low)
    for _ in range(STEPS):
        if at(a)[0] <= at(b)[0]:
            high, b = b, a
            a = high - ratio * (high - low)
        else:
            low, a = a, b
            b = low + ratio * (high - low)
    best = min(cache, key=lambda x: cache[x][0])
    return cache[best][0], math.exp(best), cache[best][1]


def refine(calibration: Calibration, limits: Limits,
           requests: Sequence[Request]) -> Calibration:
    chosen = sorted(requests, key=lambda r: r.started_s)[-MAX_REPLAYED:]
    arrivals = [(r.started_s, r.prompt_tokens, r.output_tokens) for r in chosen]
    observed = np.array([r.ttft_s for r in chosen])
    tried = []
    for share in FIXED_SHARES:
        fixed = replace(calibration, fixed_s=share * calibration.base_s)
        error, per_token, overhead = _search(fixed, limits, arrivals, observed)
        tried.append((error, share, per_token, overhead))
    error, share, per_token, overhead = min(tried)
    return replace(calibration, fixed_s=share * calibration.base_s, per_token_s=per_token,
                   overhead_s=overhead, ttft_error=(error, calibration.ttft_error[1]))
