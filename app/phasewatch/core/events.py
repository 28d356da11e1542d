"""What one SSE event of an OpenAI-compatible stream means for timing.

`classify` reads one event's data and says whether it carries output (and how much), usage,
an in-band error, or the end, and whether it finishes a choice. It is the only JSON parsing on
the per-chunk path, and it reads only the fields timing needs. `strip_usage` removes usage the
client did not ask for, touching no other byte of the event; `system_fingerprint` and
`add_fingerprint` move vLLM's fingerprint from the usage chunk phasewatch drops back onto the
terminal chunk, where vLLM puts it when the client did not ask for usage. None of these
re-serialises an event.

A token count in `usage` is taken only as what it can be (`token_count`): an integer from 0 to
`MAX_TOKEN_COUNT`. Anything else (a string, a float, a negative or impossibly large number) is
read as absent, as if the event had no such count: the timing never expands a broken count
into that many token gaps, and a record never holds a number its column cannot.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

import orjson

# No model's context holds this many tokens (2**24, 16.7 million): a larger count is not one.
MAX_TOKEN_COUNT = 1 << 24


def token_count(value: object) -> int | None:
    """A usage count as timing and records take it: an int (not a bool) from 0 to
    MAX_TOKEN_COUNT; None for anything else."""
    if type(value) is int and 0 <= value <= MAX_TOKEN_COUNT:
        return value
    return None


class Kind(Enum):
    OUTPUT = "output"  # carries text, content, reasoning or a tool-call delta: a token arrived
    EMPTY = "empty"  # a chunk with choices but no output: the role chunk, a finish_reason chunk
    USAGE = "usage"  # the closing usage chunk: `choices: []` and `usage`
    ERROR = "error"  # an in-band error after the 200: `data: {"error": {...}}`
    DONE = "done"  # `data: [DONE]`
    OTHER = "other"  # not JSON, or JSON we do not recognise: relayed, not timed


class EventInfo(NamedTuple):  # a tuple: built for every event, so cheap to build
    kind: Kind
    # Cumulative counts from the event's `usage`, when it has one (continuous usage or final).
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    # Characters of output in this event: the weight for estimating tokens without usage.
    chars: int = 0
    has_usage: bool = False
    # A choice in this event has its finish_reason: vLLM's terminal chunk for that choice.
    finished: bool = False
    error_message: str | None = None


_new = tuple.__new__
_DONE = EventInfo(Kind.DONE)
_OTHER = EventInfo(Kind.OTHER)


def classify(data: bytes) -> EventInfo:
    if data == b"[DONE]":
        return _DONE
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return _OTHER
    if not isinstance(obj, dict):
        return _OTHER
    error = obj.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else str(error)
        return EventInfo(Kind.ERROR, error_message=str(message)[:500])
    usage = obj.get("usage")
    completion = prompt = None
    if isinstance(usage, dict):
        completion = token_count(usage.get("completion_tokens"))
        prompt = token_count(usage.get("prompt_tokens"))
    has_usage = isinstance(usage, dict)
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return EventInfo(Kind.OTHER, completion, prompt, 0, has_usage)
    if not choices:
        kind = Kind.USAGE if has_usage else Kind.EMPTY
        return EventInfo(kind, completion, prompt, 0, has_usage)
    chars = 0
    finished = False
    for choice in choices:
        if isinstance(choice, dict):
            chars += _output_chars(choice)
            if choice.get("finish_reason") is not None:
                finished = True
    kind = Kind.OUTPUT if chars else Kind.EMPTY
    # tuple.__new__ directly: a NamedTuple's generated __new__ costs more than the tuple.
    return _new(EventInfo, (kind, completion, prompt, chars, has_usage, finished, None))


def _output_chars(choice: dict[str, Any]) -> int:
    """Characters of output in one choice; a tool-call delta counts as at least one."""
    text = choice.get("text")
    if text:  # /v1/completions
        return len(text)
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return 0
    chars = 0
    for key in ("content", "reasoning_content", "reasoning"):
        value = delta.get(key)
        if value:
            chars += len(value)
    tool_calls = delta.get("tool_calls")
    if tool_calls:
        chars += max(1, len(orjson.dumps(tool_calls)))
    return chars


USAGE_KEY = b'"usage":{'


def usage_span(raw: bytes) -> tuple[int, int] | None:
    """Where one raw compact event's `"usage":{...}` is: the key's first byte and the object's
    closing brace. None when there is none: null or absent, or JSON with spaces."""
    start = raw.rfind(USAGE_KEY)
    if start < 0:
        return None
    # Usage holds numbers and small nested objects, never strings with braces: the object ends
    # at the first closing brace where the braces since its opening one balance (counted
    # stretch by stretch, so a run of braces costs one pass, not one per brace).
    scanned = start + len(USAGE_KEY) - 1  # the object's opening brace
    depth = 0
    end = raw.find(b"}", scanned)
    while end >= 0:
        depth += raw.count(b"{", scanned, end + 1) - raw.count(b"}", scanned, end + 1)
        if depth == 0:
            return start, end
        scanned = end + 1
        end = raw.find(b"}", scanned)
    return None


def cut_usage(raw: bytes, start: int, end: int) -> bytes:
    """One raw event without the usage at `usage_span`, every other byte as it was."""
    cut = start - 1 if start > 0 and raw[start - 1] == 0x2C else start  # also drop the comma
    return raw[:cut] + raw[end + 1:]


def strip_usage(raw: bytes) -> bytes:
    """Remove the `usage` key and object from one raw event, leaving every other byte as it was.

    vLLM (0.32) writes stream chunks with set fields only: without usage asked for, a chunk has
    no `usage` key at all, in both endpoints. (vLLM 0.10 wrote completion chunks with every
    field, `"usage":null` included; phasewatch follows the current release.)
    """
    span = usage_span(raw)
    if span is not None:
        return cut_usage(raw, *span)
    if USAGE_KEY in raw or b'"usage": {' in raw:  # unbalanced, or spaced: only a parse can cut
        return _strip_usage_slow(raw)
    return raw  # null or absent


def _strip_usage_slow(raw: bytes) -> bytes:
    """Fallback for non-compact JSON: re-serialise the event without its usage."""
    head, sep, data = raw.partition(b"data:")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return raw
    if not isinstance(obj, dict) or "usage" not in obj:
        return raw
    del obj["usage"]
    return head + sep + b" " + orjson.dumps(obj) + b"\n\n"


_FINGERPRINT_KEY = b'"system_fingerprint":'


def system_fingerprint(raw: bytes) -> bytes | None:
    """The `system_fingerprint` of one raw compact event as its JSON string, quotes included
    and byte for byte; None when the event has none (or it is null, or the JSON is spaced).

    Read once per stream, from the closing usage chunk: vLLM (0.32) stamps its fingerprint
    there when usage was asked for, and on the terminal chunk otherwise.
    """
    key = raw.rfind(_FINGERPRINT_KEY)
    start = key + len(_FINGERPRINT_KEY)
    if key < 0 or raw[start:start + 1] != b'"':
        return None
    end = raw.find(b'"', start + 1)
    while end >= 0:
        backslashes = 0
        while raw[end - 1 - backslashes] == 0x5C:
            backslashes += 1
        if backslashes % 2 == 0:  # not an escaped quote: the string ends here
            return raw[start:end + 1]
        end = raw.find(b'"', end + 1)
    return None


def add_fingerprint(raw: bytes, fingerprint: bytes) -> bytes:
    """One raw terminal chunk with `"system_fingerprint":<fingerprint>` where vLLM writes it.

    vLLM declares `system_fingerprint` right after `choices` and `usage`, and the only fields
    after it (`prompt_token_ids`, `prompt_text`, `metrics`) are never set on a terminal chunk
    (the first two ride on the chat role chunk, the last on the usage chunk): with
    `exclude_unset` it is the chunk's last key. A chunk that already has one is left alone.
    """
    end = raw.rfind(b"}")
    if end < 0 or _FINGERPRINT_KEY in raw:
        return raw
    return raw[:end] + b"," + _FINGERPRINT_KEY + fingerprint + raw[end:]
