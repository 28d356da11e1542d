"""The native leg taking a stream from the upstream's head (_native.c `head_take`), driven over
socket pairs.

A streamed request counted from its first token goes to the thread as soon as it is sent. The
thread writes the client's head only for the head the Python path would answer the same way (a
plain `200` event stream, chunked), and writes it as the Python path would: Python's status
line and server headers, the upstream's headers filtered by `client_response_headers`, the
request id, the chunked framing. Every other head, and every first event but a token or vLLM's
role chunk, comes back to Python with every byte read and nothing written.
(tests/proxy/test_native_relay.py holds whole exchanges through two proxies alike.)
"""

from __future__ import annotations

import array
import select
import time
from collections.abc import Iterator
from typing import Any

import httptools
import orjson
import pytest

from phasewatch.proxy.asgi import client_response_headers
from phasewatch.proxy.native import Ending
from phasewatch.proxy.timing import Counting, StreamTiming
from tests.support.native_pair import NativePair

_native = pytest.importorskip("phasewatch.proxy._native",
                              reason="the native relay is not built here")

PREFIX = b"HTTP/1.1 200 OK\r\ndate: Fri, 04 Dec 2026 18:00:00 GMT\r\nserver: test\r\n"
REQUEST_ID = b"x-request-id: r-1\r\n"
END_OF_HEAD = b"transfer-encoding: chunked\r\n\r\n"
PLAIN = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
         b"transfer-encoding: chunked\r\n\r\n")


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _token(completion: int) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": f"t{completion}"}, "logprobs": None,
                     "finish_reason": None}],
        "usage": {"prompt_tokens": 7, "total_tokens": 7 + completion,
                  "completion_tokens": completion}}) + b"\n\n"


ROLE = b"data: " + orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}],
    "usage": {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}}) + b"\n\n"


def _python_head(upstream_head: bytes) -> bytes:
    """The client's head as the Python path writes it (relay.py `_start_direct`) around the
    same prefix and end."""
    class Headers:
        def __init__(self) -> None:
            self.headers: list[tuple[bytes, bytes]] = []

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers.append((name, value))

    parsed = Headers()
    httptools.HttpResponseParser(parsed).feed_data(upstream_head)
    headers = client_response_headers(parsed.headers, "r-1", None)
    return PREFIX + b"".join(b"%b: %b\r\n" % pair for pair in headers) + END_OF_HEAD


class Pair(NativePair):
    """An exchange handed to the thread as its request went out, between socket pairs."""

    def __init__(self, relay: Any, strip: bool = True) -> None:
        super().__init__(relay, strip, strip, (PREFIX, REQUEST_ID, END_OF_HEAD))

    def relayed(self, events: int) -> None:
        """Wait until the client has this many whole events."""
        self.wait_for(lambda received: received.count(b"\n\n\r\n") >= events)


@pytest.fixture
def relay() -> Iterator[Any]:
    relay = _native.Relay()
    yield relay
    relay.close()


@pytest.fixture
def pair(relay: Any) -> Iterator[Pair]:
    pair = Pair(relay)
    yield pair
    pair.close()


def test_the_client_head_is_the_python_paths_and_goes_out_with_the_first_token(
        pair: Pair) -> None:
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Connection: keep-alive\r\nKeep-Alive: timeout=5\r\nX-Custom:  spaced  \r\n"
            b"Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n\r\n")
    pair.send(head, _frame(ROLE), _frame(_token(1)))
    pair.relayed(2)  # the role chunk and the token, their usage cut
    expected = _python_head(head)
    assert expected.startswith(PREFIX) and b"x-custom: spaced  \r\n" in expected
    assert pair.received.startswith(expected)
    assert pair.received.count(b"data: ") == 2 and b'"usage"' not in pair.received
    assert pair.stream.head == head  # for Python's parser
    assert pair.stream.head_ns > 0
    # The log replays into a fresh timing as the Python path times these events: the role
    # chunk is no token; the token is the first, at its read.
    timing = StreamTiming(0)
    timing.single_choice = True
    events, last_read_ns, _ = pair.stream.poll()
    timing.exact_events(array.array("q", events))
    assert timing.counting is Counting.EXACT
    assert timing.first_output_ns == last_read_ns and timing.tokens_seen == 1


def test_the_upstreams_own_request_id_is_kept(pair: Pair) -> None:
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nX-Request-Id: theirs\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    pair.send(head, _frame(_token(1)))
    pair.relayed(1)
    assert pair.received.startswith(_python_head(head))
    assert b"x-request-id: theirs\r\n" in pair.received and REQUEST_ID not in pair.received


def test_a_head_that_comes_in_pieces_is_taken_when_it_is_whole(pair: Pair) -> None:
    pair.send(PLAIN[:20])
    pair.send(PLAIN[20:], _frame(_token(1)))
    pair.relayed(1)
    assert pair.received.split(b"\r\n\r\n")[0] + b"\r\n\r\n" == _python_head(PLAIN)
    assert pair.stream.head == PLAIN


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
    b"content-length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 99\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n",  # a body until close
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: gzip, chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-a: 1\r\n folded\r\n"
    b"transfer-encoding: chunked\r\n\r\n",
    b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n" + PLAIN,
    b"HTTP/1.1 200 O\x7fK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-a: b\x01c\r\n"
    b"transfer-encoding: chunked\r\n\r\n",
], ids=["error", "json", "length", "until-close", "gzip", "folded", "http-1.0", "interim",
        "control-in-status", "control-in-value"])
def test_any_other_head_goes_back_to_python_whole_and_unanswered(pair: Pair,
                                                                 head: bytes) -> None:
    pair.send(head + _frame(_token(1)))
    stream = pair.back()
    assert stream.ending == Ending.HANDOVER
    assert stream.leftover == head + _frame(_token(1))
    assert stream.head is None
    assert pair.received == b"" and stream.unsent == b""


@pytest.mark.parametrize("first", [
    _frame(b"data: [DONE]\n\n"),  # no token at all
    _frame(_token(0)),  # output with a count of 0: how it is timed is Python's to say
    _frame(b'data: {"error": {"message": "boom"}}\n\n'),
], ids=["done", "uncounted", "error"])
def test_a_first_event_that_is_not_a_token_goes_back_after_the_head(pair: Pair,
                                                                    first: bytes) -> None:
    pair.send(PLAIN, first)
    stream = pair.back()
    assert stream.ending == Ending.HANDOVER
    assert pair.received + stream.unsent == _python_head(PLAIN)  # the head alone
    assert stream.leftover == first
    assert stream.head == PLAIN
    assert stream.poll()[0] == b""  # nothing logged


def test_a_stop_before_the_head_hands_back_what_came_of_it(pair: Pair) -> None:
    pair.send(PLAIN[:30])
    while pair.stream.clocks()[0] == 0:
        select.select([], [], [], 0.01)
    pair.stream.stop()
    stream = pair.back()
    assert stream.ending == Ending.ASKED
    assert stream.leftover == PLAIN[:30]
    assert stream.head is None and pair.received == b""


def test_the_live_pass_is_named_the_stream_until_a_poll_took_its_first_token(
        relay: Any, pair: Pair) -> None:
    """`Relay.due` (live.py's pass): a stream started at its head is named on every pass until
    a poll has taken its first token; then only when its replay is due or its clocks are past
    a timeout. Nothing else held is named."""
    def named(replay_before: int = 0, idle_before: int = 0) -> bool:
        owners = relay.due(replay_before, idle_before, 0)
        assert owners in ([], [pair])
        return owners == [pair]

    assert named()  # no head yet, no read: named
    pair.send(PLAIN, _frame(ROLE))
    pair.relayed(1)
    pair.stream.poll()
    assert named()  # the role chunk polled: still no token
    pair.send(_frame(_token(1)))
    pair.relayed(2)
    assert named()  # the token is read, not yet polled
    pair.stream.poll()
    assert not named()  # polled: nothing due, no timeout near
    now = time.perf_counter_ns()  # the thread's clock (CLOCK_MONOTONIC)
    assert named(replay_before=now)  # its last poll is before `now`: a replay is due
    assert named(idle_before=now)  # its last read is before `now`: maybe silent too long
    assert not named(replay_before=now - 60 * 10**9, idle_before=now - 60 * 10**9)
