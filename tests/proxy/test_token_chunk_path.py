"""The byte-read path for running token chunks (`StreamFeed._token_chunk`) agrees with the
general path (full parse, `classify`) on every read: the bytes forwarded, the timing, the
samples observed and the record; and it is really taken for plain token chunks."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.proxy.request_plan import plan_request
from phasewatch.proxy.stream import StreamFeed
from phasewatch.proxy.timing import StreamTiming, figures

MS = 1_000_000


def _event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _usage(completion: int, details: bool = False) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": 7, "total_tokens": 7 + completion,
                             "completion_tokens": completion}
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": 0}
    return usage


def _chat(content: str | None, completion: int, finish: str | None = None,
          details: bool = False, role: bool = False) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    return _event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                   "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}],
                   "usage": _usage(completion, details)})


def _text(text: str, completion: int, finish: str | None = None) -> bytes:
    return _event({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                   "choices": [{"index": 0, "text": text, "logprobs": None,
                                "finish_reason": finish, "stop_reason": None}],
                   "usage": _usage(completion)})


STREAM = [
    _chat(None, 0, role=True),  # the role chunk: no token
    _chat("He", 1),  # the first token
    _chat("llo", 2),
    _chat(" wor", 4),  # two tokens in one chunk
    _chat("", 4),  # a chunk whose count did not rise: no token
    _chat("\u00e9", 5),  # a partial character's completion
    _chat('"finish_reason":null,"usage":{"completion_tokens":99}', 6),  # patterns in a string
    _chat("x", 7, details=True),  # usage with nested token details
    b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "s"}, '
    b'"finish_reason": null}], "usage": {"prompt_tokens": 7, "completion_tokens": 8}}\n\n',
    _chat("d", 9),
    _chat("", 9, finish="length"),  # the terminal chunk (held for the fingerprint)
    _event({"id": "chatcmpl-1", "choices": [], "usage": _usage(9),
            "system_fingerprint": "fp_1"}),
    b"data: [DONE]\n\n",
]
TEXT_STREAM = [_text("a", 1), _text("b", 2), _text("cd", 4), _text("", 4, finish="stop"),
               _event({"id": "cmpl-1", "choices": [], "usage": _usage(4)}),
               b"data: [DONE]\n\n"]
ERROR_STREAM = [_text("a", 1), _text("b", 2),
                _event({"error": {"message": "boom", "code": 500}}), b"data: [DONE]\n\n"]


def _run(body: dict[str, Any], stream: list[bytes]) -> tuple[Any, ...]:
    plan = plan_request(orjson.dumps(body), continuous_usage=True)
    record = RequestRecord(request_id="r", started_at=datetime.now(UTC), endpoint="chat",
                           model="m", upstream="u", stream=True, outcome=Outcome.OK,
                           http_status=200, in_flight_at_arrival=0, run_id=None)
    ttft: list[float] = []
    itl: list[tuple[float, Any]] = []
    timing = StreamTiming(arrival_ns=0, observe_ttft=lambda v, e=None: ttft.append(v),
                          observe_itl=lambda v, e=None: itl.append((v, e)),
                          exemplar={"request_id": "r"})
    feed = StreamFeed(plan, record, timing)
    out = [feed.feed(data, (i + 1) * 10 * MS + i * i * MS) for i, data in enumerate(stream)]
    out.append(feed.end(len(stream) * 20 * MS))
    timing.end_ns = len(stream) * 20 * MS
    timing.settle()
    return (out, ttft, itl, figures(timing), timing.completion_tokens, timing.prompt_tokens,
            record.outcome, record.error, feed.done)


@pytest.mark.parametrize(("stream", "first"), [(STREAM, 1), (TEXT_STREAM, 0), (ERROR_STREAM, 0)],
                         ids=["chat", "completions", "in-band error"])
@pytest.mark.parametrize("options", [None, {"include_usage": True},
                                     {"include_usage": True, "continuous_usage_stats": True}],
                         ids=["no usage asked", "final usage asked", "running usage asked"])
def test_byte_read_path_agrees_with_the_general_path(
    monkeypatch: pytest.MonkeyPatch, stream: list[bytes], first: int,
    options: dict[str, Any] | None,
) -> None:
    body: dict[str, Any] = {"model": "m", "stream": True}
    if options is not None:
        body["stream_options"] = options
    taken: list[bytes] = []
    byte_read = StreamFeed._token_chunk

    def counting(self: StreamFeed, data: bytes, now: int) -> bytes | None:
        out = byte_read(self, data, now)
        if out is not None:
            taken.append(data)
        return out

    monkeypatch.setattr(StreamFeed, "_token_chunk", counting)
    fast = _run(body, stream)
    monkeypatch.setattr(StreamFeed, "_token_chunk", lambda self, data, now: None)
    general = _run(body, stream)
    assert fast == general
    # Taken for the plain running chunks after the first token, and only for them.
    plain = [data for data in stream[first + 1:]
             if b'"finish_reason":null' in data and b'"usage": {' not in data]
    assert taken == plain and taken
