"""What one SSE event of an OpenAI-compatible stream means for timing.

`classify` reads one event's data and says whether it carries output (and how much), usage,
an in-band error, or the end. It is the only JSON parsing on the per-chunk path, and it reads
only the fields timing needs. `strip_usage` removes usage the client did not ask for, touching
no other byte of the event.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

import orjson


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
    error_message: str | None = None


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
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
    has_usage = isinstance(usage, dict)
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return EventInfo(Kind.OTHER, completion, prompt, 0, has_usage)
    if not choices:
        kind = Kind.USAGE if has_usage else Kind.EMPTY
        return EventInfo(kind, completion, prompt, 0, has_usage)
    chars = 0
    for choice in choices:
        chars += _output_chars(choice)
    kind = Kind.OUTPUT if chars else Kind.EMPTY
    return EventInfo(kind, completion, prompt, chars, has_usage)


def _output_chars(choice: Any) -> int:
    """Characters of output in one choice; a tool-call delta counts as at least one."""
    if not isinstance(choice, dict):
        return 0
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


_USAGE_KEY = b'"usage":{'


def strip_usage(raw: bytes, keep_null: bool) -> bytes:
    """Remove the `usage` object from one raw event, leaving every other byte as it was.

    vLLM writes completion chunks with every field (so `"usage":null` when usage was not
    asked for) and chat chunks with set fields only (no `usage` key): `keep_null` chooses
    between the two so the client sees what the upstream would have sent it.
    """
    start = raw.rfind(_USAGE_KEY)
    if start < 0:
        # Already null or absent; or JSON with spaces, which only the slow path can cut.
        return _strip_usage_slow(raw, keep_null) if b'"usage": {' in raw else raw
    pos = start + len(_USAGE_KEY) - 1  # the object's opening brace
    end = raw.find(b"}", pos)
    # Usage holds numbers and small nested objects, never strings with braces: balance them.
    while end >= 0 and raw.count(b"{", pos, end + 1) != raw.count(b"}", pos, end + 1):
        end = raw.find(b"}", end + 1)
    end = end + 1 if end >= 0 else -1
    if end < 0:
        return _strip_usage_slow(raw, keep_null)
    if keep_null:
        return raw[: pos] + b"null" + raw[end:]
    cut = start - 1 if start > 0 and raw[start - 1] == 0x2C else start  # also drop the comma
    return raw[:cut] + raw[end:]


def _strip_usage_slow(raw: bytes, keep_null: bool) -> bytes:
    """Fallback for non-compact JSON: re-serialise the event without its usage."""
    head, sep, data = raw.partition(b"data:")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return raw
    if not isinstance(obj, dict) or "usage" not in obj:
        return raw
    if keep_null:
        obj["usage"] = None
    else:
        del obj["usage"]
    return head + sep + b" " + orjson.dumps(obj) + b"\n\n"
