"""The exchange's state machine (app/phasewatch/proxy/exchange_state.py): every phase answers every
event, by a move in the table or by refusing it; the first ending wins; what may still
arrive after an ending leaves it as it is; nothing leaves an ending but a retry of a
connection broken before any answer."""

from __future__ import annotations

import pytest

from phasewatch.proxy.exchange_state import (
    ENDINGS,
    TRANSITIONS,
    Event,
    IllegalTransition,
    Phase,
    next_phase,
)

OPEN = [phase for phase in Phase if phase not in ENDINGS]


def test_every_phase_has_its_row() -> None:
    assert set(TRANSITIONS) == set(Phase)


@pytest.mark.parametrize("ending", sorted(ENDINGS, key=lambda p: p.value))
def test_an_ending_stays_whatever_comes_late(ending: Phase) -> None:
    for event in Event:
        if event in (Event.SENT, Event.RETRY):
            continue
        assert next_phase(ending, event) is ending
    with pytest.raises(IllegalTransition):
        next_phase(ending, Event.SENT)


def test_only_a_broken_exchange_retries() -> None:
    assert next_phase(Phase.BROKEN, Event.RETRY) is Phase.CONNECTING
    for phase in Phase:
        if phase is not Phase.BROKEN:
            with pytest.raises(IllegalTransition):
                next_phase(phase, Event.RETRY)


def test_the_open_phases_move_as_a_stream_lives() -> None:
    phase = Phase.CONNECTING
    for event, to in ((Event.SENT, Phase.WAITING), (Event.HEAD_STREAM, Phase.STREAMING),
                      (Event.CLIENT_LEFT_ANSWERED, Phase.STREAMING),
                      (Event.BODY_END, Phase.ENDED)):
        phase = next_phase(phase, event)
        assert phase is to
    assert next_phase(Phase.WAITING, Event.HEAD_WHOLE) is Phase.READING
    assert next_phase(Phase.READING, Event.BODY_END) is Phase.ENDED
    for phase in OPEN:
        assert next_phase(phase, Event.CLIENT_LEFT) is Phase.CLIENT_GONE
        assert next_phase(phase, Event.IDLE) is Phase.IDLE_TIMEOUT
        assert next_phase(phase, Event.SHUTDOWN) is Phase.SHUT_DOWN


@pytest.mark.parametrize(("phase", "event"), [
    (Phase.CONNECTING, Event.HEAD_STREAM), (Phase.CONNECTING, Event.BODY_END),
    (Phase.WAITING, Event.SENT), (Phase.STREAMING, Event.HEAD_STREAM),
    (Phase.STREAMING, Event.SENT), (Phase.READING, Event.STALL),
    (Phase.WAITING, Event.CLIENT_LEFT_ANSWERED),
])
def test_an_event_out_of_place_is_refused(phase: Phase, event: Event) -> None:
    with pytest.raises(IllegalTransition, match=f"{event.value} is not allowed in phase"):
        next_phase(phase, event)
