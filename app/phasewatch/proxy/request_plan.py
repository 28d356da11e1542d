"""How an inference request is sent upstream: the one change phasewatch makes to it.

To count tokens exactly, a streamed request asks the upstream for usage
(`stream_options.include_usage`, plus `continuous_usage_stats` for per-chunk counts). What
the client did not ask for is stripped from the response, so its stream is the one it would
have had. Where the client sent no `stream_options` (the usual case), the member is appended
to its body's text, and every other byte goes upstream as it came: whitespace, key order,
number spellings and string escapes. Where it sent its own that must change, the body is
written anew from its parsed value: the same JSON value, the same keys in the same order, but
compact, numbers as orjson writes them, strings unescaped where JSON allows. A body that is
not a JSON object is forwarded as it came, for the upstream to judge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from phasewatch.proxy.labels import model_name


# Not frozen: one is built per request, and a frozen dataclass's constructor costs several
# times a plain one's (a `object.__setattr__` per field). Nothing changes one after it is built.
@dataclass(slots=True)
class RequestPlan:
    body: bytes  # what is sent upstream
    model: str | None
    stream: bool
    strip_final_usage: bool  # drop the closing `choices: []` usage chunk
    strip_chunk_usage: bool  # remove the running usage from every other chunk
    # One choice (`n` absent or 1): the upstream's running usage then counts this stream's
    # tokens (with n > 1 vLLM counts each choice apart, which says nothing per chunk).
    single_choice: bool = True
    # The upstream is asked for running usage on every chunk (by the client or by phasewatch):
    # the stream can be counted exactly from its first token.
    running_usage: bool = False


def plan_request(body: bytes, continuous_usage: bool) -> RequestPlan:
    try:
        obj: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return RequestPlan(body, None, False, False, False)
    if not isinstance(obj, dict):
        return RequestPlan(body, None, False, False, False)
    model = model_name(obj.get("model"))  # as kept for labels and records, not as sent
    stream = obj.get("stream") is True
    single = obj.get("n") in (None, 1)
    options = obj.get("stream_options")
    if not stream or not (options is None or isinstance(options, dict)):
        return RequestPlan(body, model, stream, False, False, single)
    options = options or {}
    wants_usage = options.get("include_usage") is True
    wants_continuous = wants_usage and options.get("continuous_usage_stats") is True
    add_continuous = continuous_usage and not wants_continuous
    if wants_usage and not add_continuous:
        return RequestPlan(body, model, stream, False, False, single, wants_continuous)
    new_options = {**options, "include_usage": True}
    if add_continuous:
        new_options["continuous_usage_stats"] = True
    return RequestPlan(_with_options(body, obj, new_options), model, stream, not wants_usage,
                       add_continuous, single, add_continuous or wants_continuous)


_JSON_SPACE = b" \t\r\n"  # what RFC 8259 allows around a value (all orjson accepts)
# The member appended to a body without `stream_options` (the usual case), made once.
_USAGE_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
_USAGE_MEMBER = b',"stream_options":' + orjson.dumps(_USAGE_OPTIONS) + b"}"


def _with_options(body: bytes, obj: dict[str, Any], options: dict[str, bool]) -> bytes:
    """`body` (a JSON object, parsed as `obj`) with `stream_options` set to `options`."""
    if "stream_options" not in obj:
        # No member of that name, escaped or not: append one before the object's closing
        # brace, the last byte of its text but for trailing whitespace. The object has a
        # member already (`stream`), so a comma goes first.
        text = body.rstrip(_JSON_SPACE)
        if text.endswith(b"}"):
            member = (_USAGE_MEMBER if options == _USAGE_OPTIONS
                      else b',"stream_options":' + orjson.dumps(options) + b"}")
            return b"".join((text[:-1], member, body[len(text):]))
    obj["stream_options"] = options
    return orjson.dumps(obj)
