"""What a window says without a baseline: its latencies against the SLO, and the engine's queue
and batch as its own metrics report them.

Two uses (diagnose.py):
- **Cold start.** With too few baseline requests to compare with (a proxy just deployed in
  front of a busy engine), a window with enough requests of its own is still judged: within
  the SLO is healthy; a miss is named from the engine's figures where they name a cause
  (requests waiting in the engine: queueing; a batch decoding with nothing waiting: decode
  saturation), else `unexplained`. Marked baseline-free, at lower confidence.
- **The engine's queue as a fact.** `engine_queue` says whether requests waited in the engine
  over the window (its waiting count and, where reported, its queue time), so a TTFT rise is
  never called queueing while the engine had nothing waiting.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from phasewatch.diagnosis.observations import EngineSignals
from phasewatch.diagnosis.verdicts import Verdict

# Without a baseline a verdict is at most this sure: it rests on one window and the SLO.
BASELINE_FREE_CONFIDENCE = 0.5


class EngineQueue(StrEnum):
    WAITING = "waiting"  # requests waited for a slot in the engine
    EMPTY = "empty"  # nothing waited, and the queue time (where reported) was negligible
    UNKNOWN = "unknown"  # not scraped, or too few scrapes in the window


# Requests waiting on average over the window's scrapes that make a queue still building
# (its requests not yet in the queue-time histogram, which counts them once scheduled).
SUSTAINED_WAITING = 0.5


def engine_queue(engine: EngineSignals | None, ttft_p50_s: float | None,
                 negligible_share: float, min_scrapes: int = 2) -> EngineQueue:
    """Whether requests waited in the engine over the window. Where the engine reports its
    queue time (a histogram over every request it scheduled), that decides: a mean under
    `negligible_share` of the window's TTFT median is no queue, unless half a request or more
    was waiting on average over the scrapes (`SUSTAINED_WAITING`: a queue still building). A
    request seen waiting at one scrape, between its arrival and the next step, is not a queue.
    Without a queue time, any request seen waiting is."""
    if engine is None or engine.scrapes < min_scrapes or engine.waiting_max is None:
        return EngineQueue.UNKNOWN
    queued_s = engine.queue_time_mean_s
    if queued_s is not None and ttft_p50_s is not None:
        sustained = (engine.waiting_mean or 0.0) >= SUSTAINED_WAITING
        if queued_s >= negligible_share * ttft_p50_s or sustained:
            return EngineQueue.WAITING
        return EngineQueue.EMPTY
    return EngineQueue.WAITING if engine.waiting_max >= 1 else EngineQueue.EMPTY


@dataclass(frozen=True, slots=True)
class Misses:
    """The window's p95s against the SLO thresholds (None: no SLO, or nothing measured)."""

    ttft: bool | None
    itl: bool | None
    ttft_ratio: float | None  # p95 / threshold
    itl_ratio: float | None

    @property
    def any(self) -> bool:
        return bool(self.ttft or self.itl)

    @property
    def judged(self) -> bool:
        return self.ttft is not None or self.itl is not None

    def worst(self) -> float:
        return max((r for r in (self.ttft_ratio, self.itl_ratio) if r is not None), default=0.0)


def misses(ttft_p95_s: float | None, itl_p95_s: float | None, slo_ttft_s: float | None,
           slo_itl_s: float | None) -> Misses:
    def ratio(value: float | None, slo: float | None) -> float | None:
        return None if value is None or slo is None else value / slo

    t, i = ratio(ttft_p95_s, slo_ttft_s), ratio(itl_p95_s, slo_itl_s)
    return Misses(None if t is None else t > 1, None if i is None else i > 1, t, i)


def miss_confidence(m: Misses) -> float:
    """How sure a named miss is: half at the threshold, all of it at twice the threshold."""
    return min(1.0, 0.5 + 0.5 * max(0.0, m.worst() - 1.0))


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    confidence: float
    notes: list[str]


def judge_alone(m: Misses, queue: EngineQueue, running_mean: float | None) -> Judgement | None:
    """A window judged on its own (no baseline): None when there is nothing to judge it by
    (no SLO and no engine figures)."""
    if not m.judged:
        return None
    cap = BASELINE_FREE_CONFIDENCE
    if not m.any:
        return Judgement(Verdict.HEALTHY, cap, ["TTFT and ITL p95 are within the SLO."])
    sure = cap * miss_confidence(m)
    batch = running_mean is not None and running_mean >= 2
    if queue is EngineQueue.WAITING and m.ttft:
        verdict = Verdict.OUT_OF_CAPACITY if m.itl else Verdict.QUEUEING
        return Judgement(verdict, sure, ["The engine reports requests waiting for a slot."])
    if m.itl and batch:
        note = (f"ITL misses its SLO with {running_mean:.1f} requests decoding on average"
                + (" and nothing waiting in the engine" if queue is EngineQueue.EMPTY else "")
                + ": the decode batch sets the pace.")
        return Judgement(Verdict.DECODE_SATURATION, sure, [note])
    why = {
        EngineQueue.EMPTY: "The engine reports nothing waiting: the time is spent in front of "
                           "it (proxy, network, API server) or in its steps.",
        EngineQueue.WAITING: "The engine reports requests waiting, but TTFT meets its SLO.",
        EngineQueue.UNKNOWN: "The engine's metrics are not scraped, so no cause can be named "
                             "without a baseline.",
    }[queue]
    return Judgement(Verdict.UNEXPLAINED, sure, [why])
