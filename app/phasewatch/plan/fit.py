"""Calibration: the deployment's cost per engine step, fitted to the requests it served.

The model is the simulator's unit of work, one engine step, in roofline form:

    step_s = max(per_token_s * new_tokens,
                 base_s - fixed_s + per_seq_s * decoding + per_context_token_s * context)
             + fixed_s

The first term is compute (every token the step computes: prefill chunks and one per decoding
sequence); the second is memory (the weights read once per step, and each decoding sequence's cached
context); `fixed_s` is what every step costs besides (scheduling, launches, sampling), part of
`base_s`, which a decode step alone cannot tell apart (refine.py splits it). A request's median
token gap is a typical decode step it ran in (prefill steps are the rare long ones), so the memory
terms are fitted (least squares) on each request's median gap against the batch and context it
decoded under (traffic.py). A request that did not queue waits about half a step for the step it
joins, then that step, which prefills its prompt: `per_token_s` is the value that best explains
those TTFTs (a search over one variable), and `overhead_s` the median of what they hold beyond that
(frontend, network, the proxy).

Invariants: pure; a parameter the data cannot identify (one concurrency level, prompts whose
prefill always hides under the decode step) is named in `refused` with a sentence, kept at
what the rest of the fit implies, and every prediction that leans on it says so (whatif.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from phasewatch.plan.traffic import Load, Request, loads

MIN_REQUESTS = 30
# A regressor must spread this much ((p90 - p10) / p50) to identify its coefficient.
MIN_SPREAD = 0.3
# `per_token_s` is identified when at least this share of unqueued requests had a prefill
# longer than the decode step it joined.
MIN_COMPUTE_BOUND = 0.2
TERMS = ("base_s", "fixed_s", "per_seq_s", "per_context_token_s", "per_token_s")


@dataclass(frozen=True, slots=True)
class Observed:
    """The load the calibration saw: what a prediction may lean on without extrapolating."""

    requests: int
    batch: tuple[float, float]  # p10, p90 of the time-averaged decode batch
    prompt_tokens: tuple[float, float]  # p10, p90
    output_tokens: tuple[float, float]
    in_flight_max: int


@dataclass(frozen=True, slots=True)
class Calibration:
    base_s: float
    per_seq_s: float
    per_context_token_s: float
    per_token_s: float
    overhead_s: float
    # Fit quality: R^2 of the decode fit, and the relative error (|fitted - observed| /
    # observed) of median token gaps and of unqueued TTFTs, median and p90.
    itl_r2: float
    itl_error: tuple[float, float]
    ttft_error: tuple[float, float]
    observed: Observed
    refused: dict[str, str] = field(default_factory=dict)  # term -> why it is not identified
    fixed_s: float = 0.0  # the part of base_s every step costs, compute-bound ones too

    def decode_s(self, decoding: float, context: float) -> float:
        return self.base_s + self.per_seq_s * decoding + self.per_context_token_s * context

    def step_s(self, decoding: int, context: float, new_tokens: int) -> float:
        return max(self.per_token_s * new_tokens,
                   self.decode_s(decoding, context) - self.fixed_s) + self.fixed_s

    def as_dict(self) -> dict[str, object]:
        return {
            "step": {term: getattr(self, term) for term in TERMS},
            "overhead_s": self.overhead_s,
            "fit": {"itl_r2": self.itl_r2, "itl_error_p50": self.itl_error[0],
                    "itl_error_p90": self.itl_error[1], "ttft_error_p50": self.ttft_error[0],
                    "ttft_error_p90": self.ttft_error[1]},
            "observed": {"requests": self.observed.requests,
                         "batch_p10_p90": list(self.observed.batch),
                         "prompt_tokens_p10_p90": list(self.observed.prompt_tokens),
                         "output_tokens_p10_p90": list(self.observed.output_tokens),
                         "in_flight_max": self.observed.in_flight_max},
            "refused": dict(self.refused),
        }


class CannotCalibrate(ValueError):
    """The data cannot calibrate anything; the message says why, for a person."""


def _spread(values: np.ndarray) -> float:
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return float((p90 - p10) / p50) if p50 > 0 else 0.0


def _relative_error(fitted: np.ndarray, observed: np.ndarray) -> tuple[float, float]:
    error = np.abs(fitted - observed) / observed
    return float(np.percentile(error, 50)), float(np.percentile(error, 90))


def _pair(values: np.ndarray) -> tuple[float, float]:
    low, high = np.percentile(values, [10, 90])
    return float(low), float(high)


def calibrate(requests: Sequence[Request], max_num_seqs: int | None = None) -> Calibration:
    """Fit the step model to `requests` (finished, streamed, two or more output tokens).
    `max_num_seqs`: the engine's cap where known; a request that arrived with that many in
    flight may have queued, and does not calibrate the prefill."""
    usable = [r for r in requests
              if r.output_tokens >= 2 and r.decode_s > 0 and r.ttft_s > 0 and r.itl_p50_s > 0]
    if len(usable) < MIN_REQUESTS:
        raise CannotCalibrate(
            f"{len(usable)} finished streamed requests with two or more output tokens; "
            f"calibration needs at least {MIN_REQUESTS}")
    load: list[Load] = loads(usable)
    gap = np.array([r.itl_p50_s for r in usable])
    batch = np.array([x.batch for x in load])
    context = np.array([x.context for x in load])
    prompt = np.array([r.prompt_tokens for r in usable], dtype=np.float64)
    output = np.array([r.output_tokens for r in usable], dtype=np.float64)
    observed = Observed(len(usable), _pair(batch), _pair(prompt), _pair(output),
                        max(x.in_flight_at_arrival for x in load) + 1)

    # The memory side, on the median gaps.
    refused: dict[str, str] = {}
    b10, b90 = observed.batch
    if _spread(batch) < MIN_SPREAD:
        refused["per_seq_s"] = (
            f"the decode batch stayed between {b10:.1f} and {b90:.1f} (p10-p90): one "
            "concurrency level cannot tell a sequence's cost from the step's fixed cost; "
            "calibrate on traffic at two or more levels (a `phasewatch bench` sweep)")
    per_seq_context = np.divide(context, batch, out=np.zeros_like(context), where=batch > 0)
    if _spread(per_seq_context) < MIN_SPREAD:
        refused["per_context_token_s"] = (
            "the context per sequence hardly varied (prompts and outputs of one length): a "
            "held token's cost cannot be told from a sequence's")
    columns = {"base_s": np.ones_like(gap), "per_seq_s": batch, "per_context_token_s": context}
    keep = [term for term in columns if term not in refused]
    coefficients, *_ = np.linalg.lstsq(np.column_stack([columns[t] for t in keep]), gap,
                                       rcond=None)
    memory = {term: 0.0 for term in columns} | {
        term: max(0.0, float(c)) for term, c in zip(keep, coefficients, strict=True)}
    fitted_gap = (memory["base_s"] + memory["per_seq_s"] * batch
                  + memory["per_context_token_s"] * context)
    residual = gap - fitted_gap
    r2 = 1.0 - float(residual @ residual) / (float(((gap - gap.mean()) ** 2).sum()) or 1.0)

    # The compute side, on the TTFTs of requests that did not queue.
    arrived = np.array([x.batch_at_arrival for x in load], dtype=np.float64)
    step_at_arrival = (memory["base_s"] + memory["per_seq_s"] * arrived
                       + memory["per_context_token_s"] * arrived * per_seq_context)
    unqueued = np.array([max_num_seqs is None or x.in_flight_at_arrival < max_num_seqs
                         for x in load])
    ttft = np.array([r.ttft_s for r in usable])[unqueued]
    wait, joined = 0.5 * step_at_arrival[unqueued], step_at_arrival[unqueued]
    tokens = prompt[unqueued] + arrived[unqueued]

    def engine_ttft(per_token: float) -> np.ndarray:
        result: np.ndarray = wait + np.maximum(per_token * tokens, joined)
        return result

    def error(per_token: float) -> float:
        fitted = engine_ttft(per_token)
        overhead = max(0.0, float(np.median(ttft - fitted)))
        return float(np.median(np.abs(fitted + overhead - ttft) / ttft))

    candidates = np.geomspace(1e-8, 1e-2, 241)
    per_token = float(candidates[int(np.argmin([error(c) for c in candidates]))])
    compute_bound = float(np.mean(per_token * tokens > joined))
    if compute_bound < MIN_COMPUTE_BOUND:
        refused["per_token_s"] = (
            f"only {compute_bound:.0%} of the requests that did not queue had a prefill longer "
            "than the decode step it joined: the prompts' compute cost hides under the "
            "step; calibrate with longer prompts to predict longer ones")
    overhead = max(0.0, float(np.median(ttft - engine_ttft(per_token))))
    return Calibration(
        base_s=memory["base_s"], per_seq_s=memory["per_seq_s"],
        per_context_token_s=memory["per_context_token_s"], per_token_s=per_token,
        overhead_s=overhead, itl_r2=r2, itl_error=_relative_error(fitted_gap, gap),
        ttft_error=_relative_error(engine_ttft(per_token) + overhead, ttft),
        observed=observed, refused=refused)
