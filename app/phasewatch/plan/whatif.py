"""What-ifs: a calibrated deployment run through the simulator's scheduler, without a clock.

`predict` replays a workload (an open-loop Poisson rate, or N closed-loop users) through
`phasewatch.sim.scheduler.Scheduler` with the calibrated step cost (`FittedCost`) on one
replica, and reports TTFT and token-gap percentiles and the share of requests and gaps within
each SLO threshold. `replicas_needed` finds the fewest replicas, each taking an equal share of
the load, that meet both objectives.

Invariants: pure and deterministic for a given seed; times are model seconds from the first
arrival; the first `WARMUP_SHARE` of requests (by arrival) are not counted, so a prediction is
of the steady state; a prediction outside the load the calibration observed says so
(`Prediction.extrapolated`), and one that leans on a parameter the data could not identify
names it (`Prediction.unidentified`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from phasewatch.plan.fit import Calibration
from phasewatch.plan.traffic import Request
from phasewatch.sim.costmodel import StepCost, StepCoster, Work
from phasewatch.sim.offline import Clockless
from phasewatch.sim.scheduler import Scheduler, SchedulerConfig

WARMUP_SHARE = 0.2
MAX_REPLICAS = 64
# Extrapolation: a predicted decode batch beyond the observed p10-p90 by this factor.
EXTRAPOLATION_FACTOR = 1.25


class FittedCost:
    """The calibrated step model, in the shape the scheduler asks for (`StepCoster`)."""

    def __init__(self, calibration: Calibration) -> None:
        self.calibration = calibration

    def step_cost(self, works: Iterable[Work]) -> StepCost:
        decoding = 0
        context = 0
        tokens = 0
        for work in works:
            tokens += work.num_new
            if work.num_new == 1:
                decoding += 1
                context += work.num_computed + 1
        duration = self.calibration.step_s(decoding, context, tokens)
        return StepCost(flops=0.0, bytes=0.0, compute_s=duration, memory_s=0.0, overhead_s=0.0)


@dataclass(frozen=True, slots=True)
class Lengths:
    """Prompt and output lengths to draw from: fixed, or the observed ones resampled."""

    prompt: Sequence[int]
    output: Sequence[int]

    def draw(self, rng: np.random.Generator) -> tuple[int, int]:
        return (int(self.prompt[int(rng.integers(len(self.prompt)))]),
                max(2, int(self.output[int(rng.integers(len(self.output)))])))


@dataclass(frozen=True, slots=True)
class Workload:
    """Exactly one of `rate_rps` (Poisson arrivals) or `concurrency` (closed-loop users)."""

    lengths: Lengths
    rate_rps: float | None = None
    concurrency: int | None = None
    requests: int = 2000  # arrivals simulated (closed loop: requests completed)

    def share(self, replicas: int) -> Workload:
        """What one of `replicas` replicas gets."""
        if self.rate_rps is not None:
            return Workload(self.lengths, rate_rps=self.rate_rps / replicas,
                            requests=self.requests)
        assert self.concurrency is not None
        return Workload(self.lengths, concurrency=max(1, math.ceil(self.concurrency / replicas)),
                        requests=self.requests)


@dataclass(frozen=True, slots=True)
class Limits:
    """The engine's scheduler limits for the what-if."""

    max_num_seqs: int
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    num_kv_blocks: int = 1 << 30  # the KV cache is not modelled: never full
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_p50_s: float
    ttft_p95_s: float
    itl_p50_s: float
    itl_p95_s: float
    ttft_share: float  # requests with TTFT within the TTFT threshold
    itl_share: float  # token gaps within the ITL threshold
    batch_mean: float  # sequences decoding per step, on average
    requests: int  # counted (after the warm-up)
    extrapolated: list[str] = field(default_factory=list)
    unidentified: list[str] = field(default_factory=list)

    def meets(self, objective: float) -> bool:
        return self.ttft_share >= objective and self.itl_share >= objective


def _nearest_rank(ordered: np.ndarray, q: float) -> float:
    return float(ordered[max(0, math.ceil(q * ordered.size) - 1)])


@dataclass(slots=True)
class Replayed:
    """What one replay produced, per request number: arrival, lengths, token times."""

    arrival: dict[int, float] = field(default_factory=dict)
    lengths: dict[int, tuple[int, int]] = field(default_factory=dict)
    tokens: dict[int, list[float]] = field(default_factory=dict)
    steps: int = 0
    decoding: int = 0  # sequences decoding, summed over steps

    def requests(self) -> list[Request]:
        """Every finished request with two or more tokens, as the proxy would store it."""
        out = []
        for n in sorted(self.arrival):
            times = self.tokens.get(n, [])
            if len(times) < 2:
                continue
            gaps = np.diff(times)
            out.append(Request(self.arrival[n], times[0] - self.arrival[n],
                               times[-1] - self.arrival[n], self.lengths[n][0], len(times),
                               float(np.median(gaps))))
        return out


def _engine(cost: StepCoster, limits: Limits) -> Clockless:
    return Clockless(Scheduler(SchedulerConfig(
        limits.max_num_seqs, limits.max_num_batched_tokens, limits.enable_chunked_prefill,
        limits.num_kv_blocks, limits.block_size), cost))


def replay(cost: StepCoster, overhead_s: float, limits: Limits, workload: Workload,
           seed: int = 0) -> Replayed:
    """Drive `workload` through a scheduler with `cost` (the calibrated one, or the
    simulator's own cost model: the engine a benchmark measures predictions against)."""
    rng = np.random.default_rng(seed)
    engine = _engine(cost, limits)
    out = Replayed()
    ids = itertools.count()

    def send(at: float) -> None:
        number = next(ids)
        out.arrival[number] = at
        out.lengths[number] = prompt, output = workload.lengths.draw(rng)
        out.tokens[number] = []
        engine.add(at + overhead_s, str(number), prompt, output)

    if workload.rate_rps is not None:
        for at in np.cumsum(rng.exponential(1.0 / workload.rate_rps, workload.requests)):
            send(float(at))
    else:
        assert workload.concurrency is not None
        for _ in range(workload.concurrency):
            send(0.0)
    done = 0
    for _, end, step in engine.steps():
        out.steps += 1
        out.decoding += step.num_decodes
        for token in step.tokens:
            number = int(token.request_id)
            out.tokens[number].append(end)
            if token.finished:
                done += 1
                if workload.concurrency is not None and next_allowed(done, workload):
                    send(end)
    return out


def _replay(calibration: Calibration, limits: Limits, workload: Workload,
            seed: int) -> tuple[list[float], list[float], float]:
    """TTFTs and every token gap of the counted requests, and the mean decode batch."""
    done = replay(FittedCost(calibration), calibration.overhead_s, limits, workload, seed)
    counted = sorted(done.arrival)[int(len(done.arrival) * WARMUP_SHARE):]
    ttfts = [done.tokens[n][0] - done.arrival[n] for n in counted if done.tokens.get(n)]
    gaps = [b - a for n in counted for a, b in itertools.pairwise(done.tokens.get(n, []))]
    return ttfts, gaps, done.decoding / max(done.steps, 1)


def replay_observed(calibration: Calibration, limits: Limits,
                    requests: Sequence[tuple[float, int, int]]) -> list[float]:
    """The TTFT the calibrated engine gives each of `requests` ((arrival s, prompt tokens,
    output tokens), in arrival order), replayed at their own arrival times."""
    engine = _engine(FittedCost(calibration), limits)
    start = requests[0][0] if requests else 0.0
    for i, (at, prompt, output) in enumerate(requests):
        engine.add(at - start + calibration.overhead_s, str(i), prompt, max(2, output))
    first: dict[int, float] = {}
    for _, end, step in engine.steps():
        for token in step.tokens:
            first.setdefault(int(token.request_id), end)
    return [first[i] - (at - start) for i, (at, _, _) in enumerate(requests)]


def next_allowed(done: int, workload: Workload) -> bool:
    """Closed loop: a user sends its next request while fewer than `requests` have been
    sent in all (the users already sent one each)."""
    assert workload.concurrency is not None
    return done + workload.concurrency <= workload.requests


def predict(calibration: Calibration, limits: Limits, workload: Workload, *,
            slo_ttft_s: float, slo_itl_s: float, seed: int = 0) -> Prediction:
    """One replica under `workload`."""
    ttfts, gaps, batch = _replay(calibration, limits, workload, seed)
    t, g = np.sort(np.asarray(ttfts)), np.sort(np.asarray(gaps))
    extrapolated, unidentified = [], []
    low, high = calibration.observed.batch
    if batch > high * EXTRAPOLATION_FACTOR or batch < low / EXTRAPOLATION_FACTOR:
        extrapolated.append(
            f"a decode batch of {batch:.1f} on average, outside the {low:.1f}-{high:.1f} "
            "the calibration observed")
        for term in ("per_seq_s", "per_context_token_s"):
            if term in calibration.refused:
                unidentified.append(f"{term}: {calibration.refused[term]}")
    p_low, p_high = calibration.observed.prompt_tokens
    prompts = workload.lengths.prompt
    if max(prompts) > p_high * EXTRAPOLATION_FACTOR or min(prompts) < p_low / EXTRAPOLATION_FACTOR:
        extrapolated.append(f"prompts of {min(prompts)}-{max(prompts)} tokens, outside the "
                            f"{p_low:.0f}-{p_high:.0f} observed")
        if "per_token_s" in calibration.refused:
            unidentified.append("per_token_s: " + calibration.refused["per_token_s"])
    return Prediction(
        ttft_p50_s=_nearest_rank(t, 0.5), ttft_p95_s=_nearest_rank(t, 0.95),
        itl_p50_s=_nearest_rank(g, 0.5), itl_p95_s=_nearest_rank(g, 0.95),
        ttft_share=float(np.mean(t <= slo_ttft_s)), itl_share=float(np.mean(g <= slo_itl_s)),
        batch_mean=batch, requests=int(t.size), extrapolated=extrapolated,
        unidentified=unidentified)


def replicas_needed(calibration: Calibration, limits: Limits, workload: Workload, *,
                    slo_ttft_s: float, slo_itl_s: float, objective: float,
                    seed: int = 0) -> int | None:
    """The fewest replicas (up to `MAX_REPLICAS`) whose share of `workload` meets both
    objectives; None if none does (a single request alone misses one: more replicas cannot
    help)."""
    if predict(calibration, limits, workload.share(MAX_REPLICAS), slo_ttft_s=slo_ttft_s,
               slo_itl_s=slo_itl_s, seed=seed).meets(objective) is False:
        return None
    low, high = 1, MAX_REPLICAS
    while low < high:  # meeting the objectives is monotone in the replicas
        mid = (low + high) // 2
        if predict(calibration, limits, workload.share(mid), slo_ttft_s=slo_ttft_s,
                   slo_itl_s=slo_itl_s, seed=seed).meets(objective):
            high = mid
        else:
            low = mid + 1
    return low
