"""The schedule's state between rounds: hysteresis, the healthy reference an incident cannot
absorb, and the baseline frozen at onset when no healthy span is known."""

from __future__ import annotations

from phasewatch.diagnosis.hold import (
    BaselineKind,
    Held,
    HoldRules,
    Round,
    Span,
    baseline_for,
    step,
)
from phasewatch.diagnosis.verdicts import Verdict

H, Q, CAP = Verdict.HEALTHY, Verdict.QUEUEING, Verdict.OUT_OF_CAPACITY
RULES = HoldRules(rounds=2, switch_confidence=0.95, reference_s=600)
WINDOW_S, STEP_S = 60.0, 10.0


def play(rounds: list[tuple[Verdict, float]], held: Held | None = None,
         within_slo: bool | None = True, start: float = 1000.0) -> tuple[Held, list[str]]:
    """Run rounds every STEP_S; each round's baseline is what `baseline_for` gives. Returns the
    final state and the held verdict after each round."""
    state = held or Held()
    seen = []
    for k, (verdict, confidence) in enumerate(rounds):
        now = start + k * STEP_S
        baseline, kind = baseline_for(state, Span(now - WINDOW_S - 3600, now - WINDOW_S))
        state, _ = step(state, Round(verdict, confidence, now, Span(now - WINDOW_S, now),
                                     baseline, within_slo, kind), RULES)
        assert state.verdict is not None
        seen.append(state.verdict.value)
    return state, seen


def test_the_first_round_is_taken_as_is() -> None:
    state, seen = play([(Q, 0.6)])
    assert seen == ["queueing"] and state.confidence == 0.6


def test_a_single_different_round_does_not_flip_the_verdict() -> None:
    _, seen = play([(H, 0.9), (Q, 0.7), (H, 0.9), (Q, 0.8), (H, 0.9)])
    assert seen == ["healthy"] * 5


def test_a_new_verdict_takes_hold_after_the_configured_rounds() -> None:
    _, seen = play([(H, 0.9), (Q, 0.7), (Q, 0.8), (Q, 0.8)])
    assert seen == ["healthy", "healthy", "queueing", "queueing"]
    three = HoldRules(rounds=3, switch_confidence=0.99)
    state = Held()
    out = []
    for k, verdict in enumerate([H, Q, Q, Q]):
        state, why = step(state, Round(verdict, 0.8, k, Span(k - 1, k), Span(0, 1), True), three)
        out.append((state.verdict, why["because"]))
    assert out[2] == (H, "pending: 2 of 3 round(s)")
    assert out[3] == (Q, "held 3 round(s)")


def test_overwhelming_evidence_switches_at_once() -> None:
    _, seen = play([(H, 0.9), (Q, 0.97)])
    assert seen == ["healthy", "queueing"]
    state = Held(H)
    state, why = step(state, Round(Q, 0.99, 0, Span(0, 1), Span(-1, 0), True), RULES)
    assert why["changed"] is True and why["because"].startswith("overwhelming")


def test_an_incident_is_renamed_only_after_the_rounds() -> None:
    """Two incident verdicts alternating at full confidence (a check near its threshold) do
    not flip the held one; a new regime that lasts the rounds does replace it."""
    _, seen = play([(H, 0.9), (Q, 1.0), (CAP, 1.0), (Q, 1.0), (CAP, 1.0), (Q, 1.0)])
    assert seen == ["healthy"] + ["queueing"] * 5
    _, seen = play([(Q, 1.0), (CAP, 1.0), (CAP, 1.0)])
    assert seen == ["queueing", "queueing", "out_of_capacity"]


def test_the_return_to_healthy_always_waits_the_rounds() -> None:
    _, seen = play([(Q, 0.9), (H, 0.99), (H, 0.99)])
    assert seen == ["queueing", "queueing", "healthy"]


def test_healthy_rounds_build_a_contiguous_reference_capped_in_length() -> None:
    state, _ = play([(H, 0.9)] * 100)
    assert state.healthy is not None
    assert state.healthy.until_s == 1000 + 99 * STEP_S
    assert state.healthy.seconds == RULES.reference_s  # capped
    # A round with too little data breaks the chain; the reference restarts after it.
    state, _ = play([(H, 0.9), (H, 0.9), (Verdict.INSUFFICIENT_DATA, 0.0)] * 3
                    + [(Verdict.INSUFFICIENT_DATA, 0.0)] * 6 + [(H, 0.9)] * 2, held=state,
                    start=5000)
    assert state.healthy is not None and state.healthy.seconds == WINDOW_S


def test_an_incident_is_compared_with_the_frozen_healthy_reference() -> None:
    """The incident cannot absorb the baseline: while queueing is held or pending, every
    round compares with the last healthy span, however long the incident lasts."""
    state, _ = play([(H, 0.9)] * 10)
    assert state.healthy is not None
    now = 1000 + 10 * STEP_S
    assert baseline_for(state, Span(0, 1))[1] is BaselineKind.PREVIOUS
    state, _ = play([(Q, 0.8)], held=state, start=now)  # pending
    # The reference ends where the window that first showed the incident begins.
    reference = Span(state.healthy.since_s, now - WINDOW_S)
    assert baseline_for(state, Span(0, 1)) == (reference, BaselineKind.HEALTHY_REFERENCE)
    state, seen = play([(Q, 0.8)] * 200, held=state, start=now + STEP_S)  # 33 minutes
    assert set(seen) == {"queueing"}
    assert state.healthy == reference  # never updated during the incident
    assert baseline_for(state, Span(0, 1)) == (reference, BaselineKind.HEALTHY_REFERENCE)


def test_the_reference_keeps_nothing_of_the_window_that_showed_the_incident() -> None:
    """Windows that overlapped the incident's start, diluted by the healthy traffic before
    it, read healthy and extended the reference; the incident must not be compared with its
    own start (it would read healthy). A reference wholly inside that window is dropped for
    the baseline frozen at onset."""
    state, _ = play([(H, 0.9)] * 6)  # healthy windows up to 1050
    assert state.healthy == Span(1000 - WINDOW_S, 1050)
    state, _ = play([(Q, 0.99)], held=state, start=1080)  # the incident shows in [1020, 1080]
    assert state.healthy == Span(1000 - WINDOW_S, 1020)
    assert baseline_for(state, Span(0, 1)) == (state.healthy, BaselineKind.HEALTHY_REFERENCE)
    short, _ = play([(H, 0.9)])  # one healthy window, [940, 1000]
    short, _ = play([(Q, 0.99)], held=short, start=1000 + WINDOW_S + 10)  # shows in [1010, ...]
    assert short.healthy == Span(1000 - WINDOW_S, 1000)  # ended before: kept whole
    inside, _ = play([(H, 0.9)])
    inside, _ = play([(Q, 0.99)], held=inside, start=1000)  # its window covers the reference
    assert inside.healthy is None and inside.onset_baseline is not None
    assert baseline_for(inside, Span(0, 1))[1] is BaselineKind.FROZEN_AT_ONSET


def test_a_window_missing_the_slo_never_becomes_the_reference() -> None:
    state, _ = play([(H, 0.9)] * 5, within_slo=False)
    assert state.healthy is None


def test_with_no_healthy_span_known_the_baseline_at_onset_is_frozen() -> None:
    state, _ = play([(Q, 0.9)])
    onset = state.onset_baseline
    assert onset is not None
    state, _ = play([(Q, 0.9)] * 50, held=state, start=2000)
    assert baseline_for(state, Span(0, 1)) == (onset, BaselineKind.FROZEN_AT_ONSET)
    # The incident ends: back to the span before the window, the onset baseline dropped.
    state, _ = play([(H, 0.9)] * 2, held=state, start=3000)
    assert state.verdict is H and state.onset_baseline is None
    later = Span(3100, 3200)  # a span before the window that no longer holds the incident
    assert baseline_for(state, later) == (later, BaselineKind.PREVIOUS)


def test_after_an_incident_recovered_traffic_is_judged_against_the_reference() -> None:
    """While the span before the window still holds the incident, the baseline stays the
    healthy reference, which is not extended meanwhile; once the span is clear, back to it."""
    state, _ = play([(H, 0.9)] * 10)
    assert state.healthy is not None
    reference = Span(state.healthy.since_s, 1100 - WINDOW_S)  # cut at the incident's window
    state, _ = play([(Q, 0.99)] * 5 + [(H, 0.99)] * 2, held=state, start=1100)
    assert state.verdict is H and state.incident_until_s == 1100 + 5 * STEP_S
    overlapping = Span(1100 - 3600, 1100)
    assert baseline_for(state, overlapping) == (reference, BaselineKind.HEALTHY_REFERENCE)
    state, _ = play([(H, 0.99)] * 20, held=state, start=1200)  # within the hour after it
    assert state.healthy == reference
    clear = Span(1160, 1200)
    assert baseline_for(state, clear) == (clear, BaselineKind.PREVIOUS)


def test_the_evidence_says_why() -> None:
    state = Held(H)
    state, why = step(state, Round(CAP, 0.7, 5.0, Span(4, 5), Span(0, 4), True), RULES)
    assert why == {
        "held": "healthy", "held_since_s": None, "round_verdict": "out_of_capacity",
        "round_confidence": 0.7, "candidate": "out_of_capacity", "candidate_rounds": 1,
        "rounds_needed": 2, "switch_confidence": 0.95, "changed": False,
        "because": "pending: 1 of 2 round(s)",
    }
