"""What the proxy knows of requests still in flight: the live view's shared vocabulary.

`InFlight` is one open request as of a snapshot, in plain values: the relay's live registry
(`app/phasewatch/proxy/live.py`) produces them, the store keeps each process's latest snapshot, and
the diagnosis reads them beside finished records (a request waiting 4 s for its first token is
evidence of queueing before it ends). `LiveCounts` is one model's gauges. Nothing here reads a clock
or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter


# Not frozen: a snapshot builds one per open stream (a thousand every 5 s at a thousand
# streams) and each diagnosis round as many again from the store, and a frozen dataclass's
# constructor costs several times a plain one's. Nothing changes one after it is built.
@dataclass(slots=True)
class InFlight:
    """One request still open at the proxy when the snapshot was taken."""

    model: str  # the request's model label, as on the metrics
    started_s: float  # arrival at the proxy, POSIX seconds (the clock of stored records)
    age_s: float  # arrival -> the snapshot
    ttft_s: float | None  # arrival -> first token; None while it still waits for one
    silent_s: float  # since the upstream last sent anything (or since arrival)
    itl_count: int  # token gaps observed so far
    itl_p50_s: float | None  # this request's median token gap so far
    itl_max_s: float | None  # its longest token gap so far
    prompt_tokens: int | None  # from the upstream's running usage, once it has sent some
    in_flight: int  # other requests in flight at the proxy when this one arrived

    @property
    def waiting(self) -> bool:
        """Still waiting for its first token (queued, or in prefill)."""
        return self.ttft_s is None

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> InFlight:
        return cls(*_IN_FLIGHT_VALUES(data))


# An `as_dict` mapping's values in field order, read in one call (the diagnosis reads a
# thousand per round).
_IN_FLIGHT_VALUES = itemgetter(*InFlight.__slots__)


@dataclass(frozen=True, slots=True)
class LiveCounts:
    """One model's live gauges."""

    waiting: int = 0  # streams waiting for their first token
    decoding: int = 0  # streams that have had their first token and not ended
    oldest_waiting_s: float = 0.0  # age of the oldest request still waiting (0: none waits)
    stalled: int = 0  # open streams silent for longer than the stall threshold
