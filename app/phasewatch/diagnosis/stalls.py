"""Mid-stream stalls, and whether they line up with long prefills (interference).

A request's stall factor is its longest token gap over its median gap: 1 for a perfectly even
stream, about 2 when another request's short prefill shares a step, tens when a long prefill
holds every decode step (chunked prefill off). It is relative to the request's own pace, so a
decode batch that slows every step (decode saturation) does not raise it.

A request "spikes" when its stall factor passes max(`min_stall`, `spike_factor` x the
baseline's p90 stall factor). Stalls are rising when the window's share of spiking requests
exceeds the baseline's by `spike_share` or more, significantly (two-proportion z-test).

They line up with long prefills when the spiking requests are mostly ones whose decode
overlapped a long prompt's prefill: a window request j with a prompt of at least
`long_prompt_factor` x the baseline's median prompt, whose span from arrival to first token
(queueing and prefill; its prefill ends at its first token) overlaps request i's decode (first
token to end). Spikes must be at least `min_overlap_share` overlapped, and (when there are 5+
requests of each kind) more frequent among overlapped requests than among the others.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phasewatch.core.quantiles import percentile
from phasewatch.diagnosis.compare import finite
from phasewatch.diagnosis.observations import Observation
from phasewatch.diagnosis.statistics import normal_sf, two_proportions_greater


@dataclass(frozen=True, slots=True)
class StallRules:
    min_gaps: int
    min_stall: float
    spike_factor: float
    spike_share: float
    long_prompt_factor: float
    min_overlap_share: float
    alpha: float


@dataclass(frozen=True, slots=True)
class Stalls:
    threshold: float  # a spike: stall factor at or past this
    n_window: int
    n_baseline: int
    spikes_window: int
    spikes_baseline: int
    p_value: float
    support: float  # P(share difference >= spike_share), normal approximation
    window_p90: float | None
    baseline_p90: float | None
    long_prompt_tokens: float | None  # what counts as a long prompt
    long_prefills: int  # window requests with a long prompt
    overlapped: int  # eligible window requests that overlapped a long prefill
    spikes_overlapped: int
    association_p: float | None  # spikes more frequent among overlapped requests
    rules: StallRules

    @property
    def share_window(self) -> float:
        return self.spikes_window / self.n_window if self.n_window else 0.0

    @property
    def share_baseline(self) -> float:
        return self.spikes_baseline / self.n_baseline if self.n_baseline else 0.0

    @property
    def rising(self) -> bool:
        return (self.share_window - self.share_baseline >= self.rules.spike_share
                and self.p_value < self.rules.alpha)

    @property
    def with_long_prefills(self) -> bool:
        if self.spikes_window == 0 or self.long_prefills == 0:
            return False
        share = self.spikes_overlapped / self.spikes_window
        not_overlapped = self.n_window - self.overlapped
        tested = self.association_p is not None and self.overlapped >= 5 and not_overlapped >= 5
        return share >= self.rules.min_overlap_share and (
            not tested or (self.association_p is not None and self.association_p < self.rules.alpha)
        )

    def evidence(self) -> dict[str, Any]:
        return {
            "rising": self.rising,
            "with_long_prefills": self.with_long_prefills,
            "spike_threshold_stall_factor": finite(self.threshold),
            "window": {"n": self.n_window, "spikes": self.spikes_window,
                       "share": finite(self.share_window),
                       "stall_factor_p90": finite(self.window_p90 or math.nan)},
            "baseline": {"n": self.n_baseline, "spikes": self.spikes_baseline,
                         "share": finite(self.share_baseline),
                         "stall_factor_p90": finite(self.baseline_p90 or math.nan)},
            "min_share_rise": self.rules.spike_share,
            "p_value": round(self.p_value, 6),
            "support": round(self.support, 4),
            "long_prompt_tokens": finite(self.long_prompt_tokens or math.nan),
            "long_prefills_in_window": self.long_prefills,
            "requests_overlapping_long_prefills": self.overlapped,
            "spikes_overlapping_long_prefills": self.spikes_overlapped,
            "association_p_value": (None if self.association_p is None
                                    else round(self.association_p, 6)),
        }


def stall_factor(o: Observation, min_gaps: int) -> float | None:
    if (o.itl_count < min_gaps or o.itl_p50_s is None or o.itl_max_s is None
            or o.itl_p50_s <= 0):
        return None
    return o.itl_max_s / o.itl_p50_s


def _overlaps(eligible: Sequence[Observation], long: Sequence[Observation]) -> list[bool]:
    """For each eligible request, whether some long request's arrival-to-first-token span
    overlaps its decode span (first token to end)."""
    spans = sorted((o.started_s, t) for o in long if (t := o.first_token_s) is not None)
    starts = [start for start, _ in spans]
    reach: list[float] = []  # running max of first-token times, in order of arrival
    for _, done in spans:
        reach.append(max(done, reach[-1]) if reach else done)
    out = []
    for o in eligible:
        first, end = o.first_token_s, o.ended_s
        if first is None or end is None:
            out.append(False)
            continue
        k = bisect.bisect_left(starts, end)  # long requests that arrived before i ended
        out.append(k > 0 and reach[k - 1] > first)
    return out


def analyse_stalls(
    window: Sequence[Observation], baseline: Sequence[Observation], rules: StallRules,
    min_samples: int,
) -> Stalls | None:
    """None when either side has too few requests with enough token gaps."""
    w_pairs = [(o, f) for o in window if (f := stall_factor(o, rules.min_gaps)) is not None]
    b_factors = sorted(f for o in baseline if (f := stall_factor(o, rules.min_gaps)) is not None)
    enough = max(5, math.ceil(min_samples / 2))
    if len(w_pairs) < enough or len(b_factors) < enough:
        return None
    w_factors = sorted(f for _, f in w_pairs)
    b90 = percentile(b_factors, 0.9)
    assert b90 is not None
    threshold = max(rules.min_stall, rules.spike_factor * b90)
    spiking = [f >= threshold for _, f in w_pairs]
    kw = sum(spiking)
    kb = sum(1 for f in b_factors if f >= threshold)
    nw, nb = len(w_pairs), len(b_factors)
    p_value = two_proportions_greater(kw, nw, kb, nb)
    diff = kw / nw - kb / nb
    se = math.sqrt(max(kw / nw * (1 - kw / nw) / nw + kb / nb * (1 - kb / nb) / nb, 0.0))
    support = (normal_sf((rules.spike_share - diff) / se) if se > 0
               else float(diff >= rules.spike_share))

    prompts = sorted(o.prompt_tokens for o in baseline if o.prompt_tokens is not None)
    middle = percentile(prompts, 0.5)
    long_tokens = None if middle is None else rules.long_prompt_factor * middle
    long = ([] if long_tokens is None else
            [o for o in window if o.prompt_tokens is not None and o.prompt_tokens >= long_tokens])
    overlapped = _overlaps([o for o, _ in w_pairs], long) if long else [False] * nw
    n_over = sum(overlapped)
    k_over = sum(1 for s, v in zip(spiking, overlapped, strict=True) if s and v)
    association = (two_proportions_greater(k_over, n_over, kw - k_over, nw - n_over)
                   if n_over and nw - n_over else None)
    return Stalls(
        threshold=threshold, n_window=nw, n_baseline=nb, spikes_window=kw, spikes_baseline=kb,
        p_value=p_value, support=support, window_p90=percentile(w_factors, 0.9),
        baseline_p90=b90, long_prompt_tokens=long_tokens, long_prefills=len(long),
        overlapped=n_over, spikes_overlapped=k_over, association_p=association, rules=rules,
    )
