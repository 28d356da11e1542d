"""The native leg's stream tail (app/phasewatch/proxy/csrc/), driven directly over socket pairs.

After the running token chunks the thread also relays what ends a stream, as the Python path
does: the terminal chunk (held for the usage chunk's fingerprint when that chunk is cut), the
usage chunk, `[DONE]` and the body's last chunk, with the response's end. The stream then
comes back once, ended (`Ending.ENDED`, `end_written`), with a wake-up of the event loop
(`fileno()` readable, `finished()`). Here each case's bytes
are compared with what `StreamFeed` forwards for the same events, and anything the thread
must not take plainly comes back to Python at that chunk's first byte.
(tests/proxy/test_native_relay.py holds whole exchanges through two proxies alike.)
"""

from __future__ import annotations

import array
import select
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.proxy.native import Ending
from phasewatch.proxy.request_plan import plan_request
from phasewatch.proxy.stream import StreamFeed
from phasewatch.proxy.timing import Counting, StreamTiming
from tests.support.native_pair import NativePair

_native = pytest.importorskip("phasewatch.proxy._native",
                              reason="the native relay is not built here")

DONE = b"data: [DONE]\n\n"
END = b"0\r\n\r\n"


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _chunk(text: str, completion: int, finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": 7, "total_tokens": 7 + completion,
                  "completion_tokens": completion}}) + b"\n\n"


def _usage(completion: int, fingerprint: str | None = "fp_1") -> bytes:
    obj: dict[str, Any] = {"id": "cmpl-1", "object": "text_completion", "created": 1,
                           "model": "m", "choices": [],
                           "usage": {"prompt_tokens": 7, "total_tokens": 7 + completion,
                                     "completion_tokens": completion}}
    if fingerprint is not None:
        obj["system_fingerprint"] = fingerprint
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# What the client asked: usage cut (the default: phasewatch asks for running usage), the
# closing usage asked (running usage cut), running usage asked (nothing cut).
ASKS = {
    "usage-cut": {},
    "final-usage": {"stream_options": {"include_usage": True}},
    "running-usage": {"stream_options": {"include_usage": True,
                                         "continuous_usage_stats": True}},
}


def _plan(ask: str) -> Any:
    body = {"model": "m", "prompt": "hi", "stream": True, **ASKS[ask]}
    return plan_request(orjson.dumps(body), True)


def _python_path(ask: str, events: list[bytes]) -> bytes:
    """What StreamFeed forwards for these events (one read each), joined."""
    record = RequestRecord(request_id="r", started_at=datetime.now(UTC), endpoint="completions",
                           model="m", upstream="u", stream=True, outcome=Outcome.OK,
                           http_status=None, in_flight_at_arrival=0)
    feed = StreamFeed(_plan(ask), record, StreamTiming(0))
    return b"".join(feed.feed(event, i + 1) for i, event in enumerate(events)) + feed.end(99)


def _unframed(data: bytes) -> bytes:
    """The payload of HTTP/1.1 chunks (without the last, empty one)."""
    out, pos = [], 0
    while pos < len(data):
        line_end = data.index(b"\r\n", pos)
        size = int(data[pos:line_end], 16)
        if size == 0:
            break
        out.append(data[line_end + 2:line_end + 2 + size])
        pos = line_end + 2 + size + 2
    return b"".join(out)


class Pair(NativePair):
    """A stream held by the thread, between two socket pairs we drive."""

    def __init__(self, relay: Any, ask: str) -> None:
        plan = _plan(ask)
        super().__init__(relay, plan.strip_chunk_usage, plan.strip_final_usage)

    def relayed(self, ending: bytes) -> None:
        """Wait until what the client got from the thread ends with `ending`."""
        self.wait_for(lambda received: received.endswith(ending))


@pytest.fixture
def relay() -> Iterator[Any]:
    relay = _native.Relay()
    yield relay
    relay.close()


def _counts(stream: Any) -> list[int]:
    events = array.array("q", stream.poll()[0])
    return list(events[1::3])


TOKENS = [_chunk(f"t{i}", i) for i in range(2, 6)]


@pytest.mark.parametrize("ask", list(ASKS))
def test_a_tail_read_at_once_ends_the_stream_in_the_thread(relay: Any, ask: str) -> None:
    tail = [_chunk("", 6, finish="length"), _usage(6), DONE]
    pair = Pair(relay, ask)
    try:
        pair.send(*(_frame(e) for e in TOKENS))
        pair.send(*(_frame(e) for e in tail), END)
        stream = pair.back()
        assert stream.ending == Ending.ENDED
        assert stream.leftover == b"" and stream.held == 0
        assert stream.done_ns > 0
        # The last read's output went out with the response's end.
        assert stream.end_written and stream.unsent == b""
        assert pair.received.endswith(_frame(DONE) + END)
        got = _unframed(pair.received)
        assert got == _python_path(ask, TOKENS + tail)
        if ask == "usage-cut":
            assert b'"finish_reason":"length"}],"system_fingerprint":"fp_1"}' in got
            assert b'"usage"' not in got
        # Tokens 2-5, the terminal chunk's count, then the usage chunk's (no token).
        assert _counts(stream) == [2, 3, 4, 5, 6, 6]
    finally:
        pair.close()


def test_the_tail_over_several_reads_goes_out_as_it_comes(relay: Any) -> None:
    pair = Pair(relay, "usage-cut")
    try:
        pair.send(_frame(TOKENS[0]))
        pair.relayed(b"\n\n\r\n")
        pair.send(_frame(_chunk("z", 3, finish="stop")))  # held: the usage chunk is cut
        pair.send(_frame(_usage(3, 'fp "quoted" \\')))
        pair.relayed(b'"}\n\n\r\n')  # the held chunk, stamped
        pair.send(_frame(DONE))
        pair.relayed(_frame(DONE))  # [DONE] goes out as it comes, not with the end
        pair.send(END)
        stream = pair.back()
        assert stream.ending == Ending.ENDED and stream.unsent == b""
        got = _unframed(pair.received)
        assert got == _python_path("usage-cut", [TOKENS[0], _chunk("z", 3, finish="stop"),
                                                 _usage(3, 'fp "quoted" \\'), DONE])
        assert b'"system_fingerprint":"fp \\"quoted\\" \\\\"}\n\n' in got
        assert _counts(stream) == [2, 3, 3]
    finally:
        pair.close()


@pytest.mark.parametrize("after", [
    [_frame(DONE), END],  # [DONE] right after a held terminal chunk: Python forwards it as is
    [_frame(_usage(9)), _frame(DONE), END],  # a usage chunk that raises the count
    [_frame(b"data: " + orjson.dumps({"error": {"message": "x"}}) + b"\n\n"), END],
])
def test_a_tail_it_cannot_take_plainly_goes_back_held(relay: Any, after: list[bytes]) -> None:
    pair = Pair(relay, "usage-cut")
    terminal = _frame(_chunk("", 6, finish="length"))
    try:
        pair.send(*(_frame(e) for e in TOKENS), terminal, *after)
        stream = pair.back()
        assert stream.ending == Ending.HANDOVER
        assert stream.held == len(terminal)
        assert stream.leftover == terminal + b"".join(after)
        assert stream.done_ns == 0
    finally:
        pair.close()


def test_anything_after_done_goes_back_to_python(relay: Any) -> None:
    pair = Pair(relay, "running-usage")
    try:
        pair.send(_frame(_chunk("", 6, finish="length")), _frame(DONE), _frame(b": late\n\n"))
        stream = pair.back()
        assert stream.ending == Ending.HANDOVER
        assert stream.leftover == _frame(b": late\n\n")
        assert stream.done_ns > 0  # [DONE] went out: Python knows the answer is whole
        assert _unframed(pair.received) == _chunk("", 6, finish="length") + DONE
    finally:
        pair.close()


def test_the_thread_counts_as_the_python_path_times(relay: Any) -> None:
    # Replayed into a timing, the thread's tail events leave what Python's own reading would.
    pair = Pair(relay, "usage-cut")
    tail = [_chunk("z", 6, finish="length"), _usage(6), DONE]
    try:
        pair.send(*(_frame(e) for e in TOKENS), *(_frame(e) for e in tail), END)
        stream = pair.back()
        timing = StreamTiming(0)
        timing.counting, timing.tokens_seen = Counting.EXACT, 1
        timing.first_output_ns = timing.last_output_ns = 1
        timing.exact_events(array.array("q", stream.poll()[0]))
        assert timing.tokens_seen == 6 and timing.completion_tokens == 6
        assert timing.prompt_tokens == 7 and timing.gaps.count == 5
    finally:
        pair.close()


def test_a_clean_end_wakes_the_event_loop_at_once(relay: Any) -> None:
    """Until the event loop takes a stream back, no one reads its client's socket: a request
    the client sends after the response's end would wait for that, and its TTFT would not show
    the wait. So every end comes back with a wake-up."""
    pair = Pair(relay, "usage-cut")
    try:
        pair.send(_frame(TOKENS[0]))
        pair.send(_frame(_chunk("", 3, finish="stop")), _frame(_usage(3)), _frame(DONE), END)
        pair.relayed(END)  # the client has its whole response
        assert _comes_back_notified(relay, pair.stream)
        assert pair.stream.ending == Ending.ENDED and pair.stream.end_written
    finally:
        pair.close()


def test_an_end_the_client_does_not_take_goes_back_at_once_with_the_rest(relay: Any) -> None:
    pair = Pair(relay, "usage-cut")
    pair.client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    pair.remote.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        terminal = _chunk("x" * 60_000, 3, finish="stop")  # more than the client's buffers hold
        pair.send(_frame(TOKENS[0]))
        pair.send(_frame(terminal), _frame(_usage(3)), _frame(DONE), END)
        ready, _, _ = select.select([relay.fileno()], [], [], 10)  # notified
        assert ready, "the stream did not come back"
        assert relay.finished() == [pair.stream]
        stream = pair.stream
        assert stream.ending == Ending.ENDED and stream.end_written
        assert stream.unsent.endswith(_frame(DONE) + END)  # the rest, for Python to write
        pair.wait_for(lambda got: len(got) > 0)
        pair.remote.setblocking(False)
        while True:  # the client reads what the thread sent
            try:
                data = pair.remote.recv(65536)
            except BlockingIOError:
                break
            pair.received += data
        got = _unframed(pair.received + stream.unsent)
        assert got == _python_path("usage-cut", [TOKENS[0], terminal, _usage(3), DONE])
    finally:
        pair.close()


def _comes_back_notified(relay: Any, stream: Any) -> bool:
    """The event loop is woken (`fileno()` readable) and `finished()` then has the stream; a
    wake-up may come a moment before the stream is published, and then another follows."""
    deadline = time.monotonic() + 10
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([relay.fileno()], [], [], left)
        if not ready:
            return False
        if stream in relay.finished():
            return True
    return False


def test_a_request_sent_while_the_thread_holds_the_stream_stays_for_the_server(
        relay: Any) -> None:
    """A request pipelined behind the response: the thread sees the client's bytes, stops
    watching for more, and leaves them in its socket for the server to read once the stream is
    back."""
    pair = Pair(relay, "usage-cut")
    try:
        pair.send(_frame(TOKENS[0]))
        pair.wait_for(lambda got: len(got) > 0)  # the thread holds the stream
        pair.remote.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        pair.send(_frame(_chunk("", 3, finish="stop")), _frame(_usage(3)), _frame(DONE), END)
        pair.relayed(END)
        assert _comes_back_notified(relay, pair.stream)
        assert pair.stream.ending == Ending.ENDED and pair.stream.end_written
        assert pair.client.recv(100) == b"POST /v1/completions HTTP/1.1\r\n"
    finally:
        pair.close()
