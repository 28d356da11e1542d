"""Faults a request can ask for with the `x-sim-fault` header (or the server applies to all).

Syntax, one fault per header value:

    stall:after=5,seconds=2    after 5 output tokens, send nothing for 2 model seconds, then go
                               on (tokens generated meanwhile arrive merged in the next chunk,
                               as vLLM merges deltas for a lagging reader)
    disconnect:after=5         after 5 output tokens, close the TCP connection without ending
                               the chunked body (non-streaming: close before any response)
    error:after=5              after 5 output tokens, send `data: {"error": {...}}` then
                               `data: [DONE]` (non-streaming: a 500 error response)
    http:500 / http:503 / ...  answer at once with that status and an OpenAI-format error body

`after` counts output tokens already sent, so `after=0` faults before the first token.
Parsing is pure; the API layer acts on the parsed fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FAULT_HEADER = "x-sim-fault"

FaultKind = Literal["stall", "disconnect", "error", "http"]


class FaultSyntaxError(ValueError):
    """The fault string does not follow the documented syntax; the message says how."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    after: int = 0  # output tokens sent before the fault strikes
    seconds: float = 0.0  # stall length, model seconds
    status: int = 0  # http status for kind "http"


_USAGE = "expected stall:after=N,seconds=S | disconnect:after=N | error:after=N | http:CODE"


def parse_fault(text: str) -> Fault:
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip().lower()
    if kind == "http":
        try:
            status = int(rest.strip())
        except ValueError:
            raise FaultSyntaxError(f"bad fault {text!r}: {_USAGE}") from None
        if not 400 <= status <= 599:
            raise FaultSyntaxError(f"bad fault {text!r}: http status must be 400-599")
        return Fault("http", status=status)
    if kind not in ("stall", "disconnect", "error"):
        raise FaultSyntaxError(f"bad fault {text!r}: {_USAGE}")

    params: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise FaultSyntaxError(f"bad fault {text!r}: {item!r} is not key=value")
        params[key.strip().lower()] = value.strip()
    allowed = {"after", "seconds"} if kind == "stall" else {"after"}
    unknown = set(params) - allowed
    if unknown:
        raise FaultSyntaxError(f"bad fault {text!r}: unknown {', '.join(sorted(unknown))}")
    try:
        after = int(params.get("after", "0"))
        seconds = float(params.get("seconds", "1"))
    except ValueError:
        raise FaultSyntaxError(
            f"bad fault {text!r}: after is an integer, seconds a number"
        ) from None
    if after < 0 or seconds < 0:
        raise FaultSyntaxError(f"bad fault {text!r}: after and seconds must not be negative")
    if kind == "stall":
        return Fault("stall", after=after, seconds=seconds)
    if kind == "disconnect":
        return Fault("disconnect", after=after)
    return Fault("error", after=after)
