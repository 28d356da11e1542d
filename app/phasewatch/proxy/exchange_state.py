"""An exchange's life as one state machine: its phases, the events that move it, one table.

In the manner of h11's `_state.py`: `Phase` is where an exchange is, `Event` what happened,
and `TRANSITIONS` the only place a phase changes (`next_phase`). An event that the table does
not allow in a phase raises `IllegalTransition`: a bug in the relay, never a silent return.

The last six phases are endings: the first ending wins, and an event that can still arrive
after it (a read that was already on its way, the client leaving, a timeout found by a pass
that started before) leaves it where it is, as the table says.

Who holds an exchange's sockets while it streams (Python, or the native leg's thread) is a
separate value (relay.py `Exchange._native`): it changes what relays the bytes, not where the
exchange is.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    CONNECTING = "connecting"  # no upstream connection yet
    WAITING = "waiting"  # the request is sent; no response head yet (queue, prefill)
    STREAMING = "streaming"  # a 200 event stream is being forwarded
    READING = "reading"  # a whole answer (not streamed, or an error status) is being read
    ENDED = "ended"  # the upstream ended its body
    BROKEN = "broken"  # the upstream connection closed or broke before the body ended
    CLIENT_GONE = "client_gone"  # the client disconnected before it had its answer
    IDLE_TIMEOUT = "idle_timeout"  # the upstream sent nothing for the idle timeout
    SHUT_DOWN = "shut_down"  # phasewatch is shutting down and the grace for streams is over
    CLIENT_STALLED = "client_stalled"  # the client stopped reading for the client stall timeout

    # Members are singletons: hashed by identity in C, not by name in Python (`Enum.__hash__`).
    __hash__ = object.__hash__


class Event(Enum):
    SENT = "sent"  # the request went out on a connection
    HEAD_STREAM = "head_stream"  # the upstream's head: a 200 event stream
    HEAD_WHOLE = "head_whole"  # the upstream's head: anything else, read whole
    BODY_END = "body_end"  # the upstream's body ended
    LOST = "lost"  # the upstream connection closed or broke, or sent what is not HTTP
    CLIENT_LEFT = "client_left"  # the client disconnected before it had its answer
    CLIENT_LEFT_ANSWERED = "client_left_answered"  # ... after `[DONE]` went to it
    IDLE = "idle"  # the live registry: the upstream was silent for the idle timeout
    STALL = "stall"  # the live registry: the client did not read for the stall timeout
    SHUTDOWN = "shutdown"  # the shutdown grace is over
    RETRY = "retry"  # a reused connection was closed before any byte of the response came

    __hash__ = object.__hash__


ENDINGS = frozenset({Phase.ENDED, Phase.BROKEN, Phase.CLIENT_GONE, Phase.IDLE_TIMEOUT,
                     Phase.SHUT_DOWN, Phase.CLIENT_STALLED})
# Endings forced by the live registry or shutdown: they may find the client not reading.
FORCED = frozenset({Phase.IDLE_TIMEOUT, Phase.SHUT_DOWN, Phase.CLIENT_STALLED})

# What can still arrive once an exchange has ended: it stays ended as it is.
_LATE = (Event.HEAD_STREAM, Event.HEAD_WHOLE, Event.BODY_END, Event.LOST, Event.CLIENT_LEFT,
         Event.CLIENT_LEFT_ANSWERED, Event.IDLE, Event.STALL, Event.SHUTDOWN)

TRANSITIONS: dict[Phase, dict[Event, Phase]] = {
    Phase.CONNECTING: {
        Event.SENT: Phase.WAITING,
        Event.CLIENT_LEFT: Phase.CLIENT_GONE,
        Event.IDLE: Phase.IDLE_TIMEOUT,
        Event.SHUTDOWN: Phase.SHUT_DOWN,
    },
    Phase.WAITING: {
        Event.HEAD_STREAM: Phase.STREAMING,
        Event.HEAD_WHOLE: Phase.READING,
        Event.LOST: Phase.BROKEN,
        Event.CLIENT_LEFT: Phase.CLIENT_GONE,
        Event.IDLE: Phase.IDLE_TIMEOUT,
        Event.SHUTDOWN: Phase.SHUT_DOWN,
    },
    Phase.STREAMING: {
        Event.BODY_END: Phase.ENDED,
        Event.LOST: Phase.BROKEN,
        Event.CLIENT_LEFT: Phase.CLIENT_GONE,
        Event.CLIENT_LEFT_ANSWERED: Phase.STREAMING,  # it has its whole answer: nothing ends
        Event.IDLE: Phase.IDLE_TIMEOUT,
        Event.STALL: Phase.CLIENT_STALLED,
        Event.SHUTDOWN: Phase.SHUT_DOWN,
    },
    Phase.READING: {
        Event.BODY_END: Phase.ENDED,
        Event.LOST: Phase.BROKEN,
        Event.CLIENT_LEFT: Phase.CLIENT_GONE,
        Event.IDLE: Phase.IDLE_TIMEOUT,
        Event.SHUTDOWN: Phase.SHUT_DOWN,
    },
    **{ending: dict.fromkeys(_LATE, ending) for ending in ENDINGS},
}
TRANSITIONS[Phase.BROKEN] = {**TRANSITIONS[Phase.BROKEN], Event.RETRY: Phase.CONNECTING}


class IllegalTransition(RuntimeError):
    """An event the exchange's state machine does not allow where it is: a bug."""

    def __init__(self, phase: Phase, event: Event) -> None:
        super().__init__(f"exchange: {event.value} is not allowed in phase {phase.value}")
        self.phase, self.event = phase, event


def next_phase(phase: Phase, event: Event) -> Phase:
    """Where `event` takes an exchange in `phase`; raises IllegalTransition."""
    to = TRANSITIONS[phase].get(event)
    if to is None:
        raise IllegalTransition(phase, event)
    return to
