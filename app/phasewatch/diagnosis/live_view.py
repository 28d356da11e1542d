"""Requests still in flight as diagnosis observations, and the queue they show before they end.

A finished record arrives one request-duration late; a live snapshot (app/phasewatch/core/live.py)
shows the same request while it runs:
- one still waiting for its first token has a TTFT of at least its age (censored): it enters
  the TTFT comparisons at that lower bound, which can only understate a rise;
- one decoding has its exact TTFT and its decode pace so far (median gap): it enters the TTFT
  and ITL comparisons as a finished request would.
A request both in a snapshot and among the window's finished records (it ended after the
snapshot) is counted once, as finished: matched by arrival time, which both carry on one clock.

`queue_evidence` asks the one question censored values answer well: are more requests
waiting longer than the baseline's TTFT p99 than chance allows? Under the baseline's
distribution a request waits past its p99 with probability 1%; k of n doing so is a binomial
tail. Pure: no clock, no I/O.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phasewatch.core.live import InFlight
from phasewatch.core.quantiles import percentile
from phasewatch.diagnosis.compare import finite
from phasewatch.diagnosis.observations import Observation, Stage
from phasewatch.diagnosis.statistics import binomial_greater

SAME_ARRIVAL_S = 1e-3  # a snapshot's request and a record of it carry the same arrival time
TAIL = 0.99  # the baseline quantile a waiting request is compared with


def live_observations(in_flight: Sequence[InFlight],
                      finished: Sequence[Observation]) -> list[Observation]:
    """The in-flight requests not already among `finished`, as observations."""
    arrivals = sorted(o.started_s for o in finished)
    out = []
    for r in in_flight:
        if _contains(arrivals, r.started_s):
            continue
        out.append(Observation(
            started_s=r.started_s, ok=True,
            ttft_s=r.ttft_s if r.ttft_s is not None else r.age_s, e2e_s=None,
            itl_count=r.itl_count, itl_p50_s=r.itl_p50_s, itl_max_s=r.itl_max_s,
            prompt_tokens=r.prompt_tokens, in_flight=r.in_flight,
            stage=Stage.WAITING if r.waiting else Stage.DECODING,
        ))
    return out


def _contains(sorted_values: list[float], value: float) -> bool:
    i = bisect_left(sorted_values, value - SAME_ARRIVAL_S)
    return i < len(sorted_values) and sorted_values[i] <= value + SAME_ARRIVAL_S


@dataclass(frozen=True, slots=True)
class QueueEvidence:
    waiting: int  # live requests still waiting for their first token
    oldest_s: float | None  # the oldest one's age
    threshold_s: float  # the baseline's TTFT p99
    past: int  # waiting requests already past it
    judged: int  # requests of the window it is counted over (timed + waiting)
    p_value: float
    rising: bool

    def evidence(self) -> dict[str, Any]:
        return {
            "waiting": self.waiting,
            "oldest_waiting_s": None if self.oldest_s is None else finite(self.oldest_s),
            "baseline_ttft_p99_s": finite(self.threshold_s),
            "waiting_past_baseline_p99": self.past, "of": self.judged,
            "p_value": round(self.p_value, 6), "rising": self.rising,
            "note": "a waiting request's TTFT is at least its age (censored)",
        }


def queue_evidence(window: Sequence[Observation], baseline_ttfts: Sequence[float],
                   alpha: float, min_past: int = 3) -> QueueEvidence | None:
    """Whether the window's waiting requests are older than the baseline's TTFT allows; None
    when nothing waits or the baseline has no TTFT."""
    waiting = [o.ttft_s for o in window if o.stage is Stage.WAITING and o.ttft_s is not None]
    threshold = percentile(sorted(baseline_ttfts), TAIL)
    if not waiting or threshold is None:
        return None
    past = sum(1 for age in waiting if age > threshold)
    judged = len(window)
    p = binomial_greater(past, judged, 1.0 - TAIL)
    return QueueEvidence(len(waiting), max(waiting), threshold, past, judged, p,
                         past >= min_past and p < alpha)

