"""The schedule's memory between rounds: the verdict it holds, and the baseline it trusts.

Two problems of a verdict recomputed from scratch every round, solved here as pure state:
- **Flapping.** Near a threshold the round's verdict can alternate. The schedule reports the
  verdict it holds; a different one replaces it only after `rounds` rounds in a row, or, from
  `healthy` or `insufficient_data` to an incident, at once when its confidence is at least
  `switch_confidence` (overwhelming evidence). A return to `healthy`, and a change from one
  incident verdict to another, always wait the rounds.
- **An incident absorbing its baseline.** With the default baseline (the span right before
  the window) a fault held long enough becomes its own baseline and reads healthy. So while
  an incident is held (or pending as a candidate) the baseline is frozen: the last span
  judged healthy (`HEALTHY_REFERENCE`: contiguous healthy windows, up to a baseline's length,
  whose latencies met the SLO, ending no later than the start of the window that first showed
  the incident), or, when none is known, the baseline of the round that first
  saw the incident (`FROZEN_AT_ONSET`, reported as not known healthy). After the incident,
  as long as the span before the window still holds some of it, the healthy reference stays
  the baseline (and is not extended): recovered traffic is not judged against the incident.

`Held` is one model's state; `baseline_for` says what the next round compares with, and
`step` folds in a round's verdict. Times are POSIX seconds; nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from phasewatch.diagnosis.verdicts import Verdict

QUIET = (Verdict.HEALTHY, Verdict.INSUFFICIENT_DATA)  # not an incident


@dataclass(frozen=True, slots=True)
class Span:
    since_s: float
    until_s: float

    @property
    def seconds(self) -> float:
        return self.until_s - self.since_s


class BaselineKind(StrEnum):
    PREVIOUS = "previous"  # the span right before the window: no incident held or pending
    HEALTHY_REFERENCE = "healthy_reference"  # the last span judged healthy, frozen
    FROZEN_AT_ONSET = "frozen_at_onset"  # none judged healthy yet: the baseline at onset


@dataclass(frozen=True, slots=True)
class HoldRules:
    rounds: int = 2  # rounds in a row a new verdict needs
    switch_confidence: float = 0.95  # ... unless its confidence is at least this
    reference_s: float = 3600.0  # the longest healthy reference kept


@dataclass(frozen=True, slots=True)
class Held:
    """One model's schedule state."""

    verdict: Verdict | None = None  # what the schedule reports (None: nothing judged yet)
    confidence: float = 0.0  # of the last round that agreed with it
    since_s: float | None = None  # when it took hold
    candidate: Verdict | None = None  # a different verdict seen in the last rounds
    candidate_rounds: int = 0
    healthy: Span | None = None  # the last contiguous span judged healthy within the SLO
    onset_baseline: Span | None = None  # the baseline when the current incident first showed
    incident_until_s: float | None = None  # the last round with an incident held or pending

    @property
    def incident(self) -> bool:
        """An incident is held, or pending as a candidate."""
        return any(v is not None and v not in QUIET for v in (self.verdict, self.candidate))


def baseline_for(held: Held, previous: Span) -> tuple[Span, BaselineKind]:
    """What the next round compares with: `previous` (the span before its window) unless an
    incident is held or pending, or `previous` still reaches into the last one; then the
    frozen reference."""
    recent = held.incident_until_s is not None and previous.since_s < held.incident_until_s
    if not (held.incident or recent):
        return previous, BaselineKind.PREVIOUS
    if held.healthy is not None:
        return held.healthy, BaselineKind.HEALTHY_REFERENCE
    if held.onset_baseline is not None:
        return held.onset_baseline, BaselineKind.FROZEN_AT_ONSET
    return previous, BaselineKind.PREVIOUS


@dataclass(frozen=True, slots=True)
class Round:
    """One round's result, as `step` needs it."""

    verdict: Verdict
    confidence: float
    at_s: float
    window: Span
    baseline: Span
    within_slo: bool | None  # the window's p95s met the SLO (None: no SLO or no data)
    baseline_kind: BaselineKind = BaselineKind.PREVIOUS  # what `baseline` was


def step(held: Held, r: Round, rules: HoldRules) -> tuple[Held, dict[str, Any]]:
    """Fold one round into the state; returns the new state and why it moved (or not)."""
    if held.verdict is None:
        new, because = replace(held, verdict=r.verdict, confidence=r.confidence, since_s=r.at_s,
                               candidate=None, candidate_rounds=0), "first round"
    elif r.verdict is held.verdict:
        new, because = replace(held, confidence=r.confidence, candidate=None,
                               candidate_rounds=0), "same as held"
    else:
        count = held.candidate_rounds + 1 if r.verdict is held.candidate else 1
        # Overwhelming evidence names an incident at once, but never renames one: a check
        # near its threshold (say, an ITL rise about 2x) would alternate two names.
        overwhelming = (held.verdict in QUIET and r.verdict not in QUIET
                        and r.confidence >= rules.switch_confidence)
        if count >= rules.rounds or overwhelming:
            because = (f"held {count} round(s)" if count >= rules.rounds else
                       f"overwhelming: confidence {r.confidence:.2f} >= "
                       f"{rules.switch_confidence:.2f}")
            new = replace(held, verdict=r.verdict, confidence=r.confidence, since_s=r.at_s,
                          candidate=None, candidate_rounds=0)
        else:
            because = f"pending: {count} of {rules.rounds} round(s)"
            new = replace(held, candidate=r.verdict, candidate_rounds=count)
    new = _remember(held, new, r, rules)
    return new, {
        "held": None if new.verdict is None else new.verdict.value,
        "held_since_s": new.since_s,
        "round_verdict": r.verdict.value, "round_confidence": r.confidence,
        "candidate": None if new.candidate is None else new.candidate.value,
        "candidate_rounds": new.candidate_rounds, "rounds_needed": rules.rounds,
        "switch_confidence": rules.switch_confidence,
        "changed": new.verdict is not held.verdict, "because": because,
    }


def _remember(before: Held, new: Held, r: Round, rules: HoldRules) -> Held:
    """Keep the healthy reference and the onset baseline up to date."""
    if not before.incident and new.incident:
        # An incident shows: freeze its baseline. It may have begun anywhere in the window
        # that showed it, and the healthy rounds just before (their windows diluted by it)
        # may hold its start: the reference ends where that window begins.
        ref, cut = new.healthy, r.window.since_s
        if ref is not None and ref.until_s > cut:
            ref = Span(ref.since_s, cut) if cut > ref.since_s else None
        new = replace(new, onset_baseline=r.baseline, healthy=ref)
    elif not new.incident:
        new = replace(new, onset_baseline=None)
    if new.incident:
        new = replace(new, incident_until_s=r.at_s)
    if (r.verdict is Verdict.HEALTHY and new.verdict is Verdict.HEALTHY and not new.incident
            and r.baseline_kind is BaselineKind.PREVIOUS and r.within_slo is not False):
        # Contiguous healthy windows extend the reference, up to `reference_s`; a gap (an
        # incident, a round with too little data) starts it again.
        ref = new.healthy
        since = (ref.since_s if ref is not None and ref.until_s >= r.window.since_s
                 else r.window.since_s)
        since = max(since, r.window.until_s - rules.reference_s)
        new = replace(new, healthy=Span(since, r.window.until_s))
    return new


def held_as_json(held: Held) -> dict[str, Any]:
    """The state as stored with the schedule's latest round (a new leader resumes from it)."""
    def span(s: Span | None) -> list[float] | None:
        return None if s is None else [s.since_s, s.until_s]

    return {
        "verdict": None if held.verdict is None else held.verdict.value,
        "confidence": held.confidence, "since_s": held.since_s,
        "candidate": None if held.candidate is None else held.candidate.value,
        "candidate_rounds": held.candidate_rounds, "healthy": span(held.healthy),
        "onset_baseline": span(held.onset_baseline),
        "incident_until_s": held.incident_until_s,
    }


def held_from_json(data: dict[str, Any]) -> Held:
    """`held_as_json` read back; a verdict this build does not know starts afresh."""
    def verdict(value: Any) -> Verdict | None:
        return Verdict(value) if value in Verdict._value2member_map_ else None

    def span(value: Any) -> Span | None:
        return None if not value else Span(float(value[0]), float(value[1]))

    return Held(verdict(data.get("verdict")), float(data.get("confidence") or 0.0),
                data.get("since_s"), verdict(data.get("candidate")),
                int(data.get("candidate_rounds") or 0), span(data.get("healthy")),
                span(data.get("onset_baseline")), data.get("incident_until_s"))
