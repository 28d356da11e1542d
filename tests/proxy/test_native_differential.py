"""The native leg against the Python path, on random upstream streams: the same bytes at the
client and the same record, whatever the upstream sends and however its writes are split.

Each case is a random vLLM-like stream (the role chunk, token chunks whose running usage is
valid, missing, standing still, jumping, negative, huge or a float, spaced JSON, comments,
in-band errors, the terminal chunk, the usage chunk, `[DONE]`), framed as HTTP/1.1 chunks
(sometimes two events in one chunk, or one event over two), written in random pieces (split
inside chunk-size lines and inside events), and often cut: closed or reset at a random byte.
It goes through two proxies, one with the native relay and one without; the client's bytes
and the stored record's figures that do not depend on time must be equal. The seeds are
fixed: a failure names its case, and re-runs it.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import Proxy

# Cases per run; more with PHASEWATCH_DIFFERENTIAL_CASES (each case takes about 0.25 s).
CASES = int(os.environ.get("PHASEWATCH_DIFFERENTIAL_CASES", "80"))
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
RESET = object()  # a script's end: the upstream resets the connection (RST)
CLOSE = object()  # a script's end: the upstream closes it (FIN)
GAP_S = 0.001  # between two writes of a script: each one a read of its own at the proxy


class ScriptUpstream:
    """Answers each request with the head and then `script`: byte pieces, each written on its
    own, ending with CLOSE, RESET or nothing (the connection then stays open for the next)."""

    def __init__(self) -> None:
        self.script: list[Any] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = conn.makefile("rb")
        try:
            while True:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = reader.readline()
                    if not line:
                        return
                    head += line
                if not head.startswith(b"POST "):  # (the engine scrape's GET /metrics)
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                reader.read(length)
                conn.sendall(HEAD)
                for piece in self.script:
                    self._stop.wait(GAP_S)
                    if piece is RESET:
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
                        return
                    if piece is CLOSE:
                        return
                    conn.sendall(piece)
        except OSError:
            return
        finally:
            reader.close()
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _usage_value(rng: random.Random, count: int) -> Any:
    return rng.choices([count, None, -count - 1, 1 << 40, count + 0.5, str(count)],
                       [80, 5, 4, 4, 4, 3])[0]


def _chunk(rng: random.Random, chat: bool, text: str, count: Any,
           finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    obj: dict[str, Any] = {"id": "x-1", "object": "chunk", "created": 1, "model": "m",
                           "choices": [choice]}
    if count is not _MISSING:
        obj["usage"] = {"prompt_tokens": 7, "total_tokens": 9, "completion_tokens": count}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_MISSING = object()


def random_events(rng: random.Random, chat: bool) -> list[bytes]:
    events = []
    if chat and rng.random() < 0.85:
        events.append(b'data: {"id":"x-1","object":"chunk","created":1,"model":"m","choices":'
                      b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                      b'"finish_reason":null}],"usage":{"prompt_tokens":7,"total_tokens":7,'
                      b'"completion_tokens":0}}\n\n')
    count = 0
    for _ in range(rng.randrange(0, 14)):
        kind = rng.choices(["token", "several", "still", "missing", "odd", "spaced", "comment",
                            "error", "back"], [60, 8, 5, 5, 6, 3, 3, 2, 3])[0]
        if kind == "token":
            count += 1
            events.append(_chunk(rng, chat, f"t{count}", count))
        elif kind == "several":
            count += rng.randrange(2, 5)
            events.append(_chunk(rng, chat, "abc", count))
        elif kind == "still":
            events.append(_chunk(rng, chat, "", count))
        elif kind == "missing":
            events.append(_chunk(rng, chat, "m", _MISSING))
        elif kind == "odd":
            events.append(_chunk(rng, chat, "o", _usage_value(rng, count + 1)))
        elif kind == "back":
            events.append(_chunk(rng, chat, "b", max(0, count - 2)))
        elif kind == "spaced":
            count += 1
            events.append(b'data: {"choices": [{"index": 0, "text": "s", "delta": {"content": '
                          b'"s"}, "finish_reason": null}], "usage": {"prompt_tokens": 7, '
                          b'"completion_tokens": %d}}\n\n' % count)
        elif kind == "comment":
            events.append(b": keep-alive\n\n")
        else:
            events.append(b'data: {"error":{"message":"boom","type":"x","code":500}}\n\n')
    if rng.random() < 0.8:
        events.append(_chunk(rng, chat, "", count, finish=rng.choice(["stop", "length"])))
    if rng.random() < 0.7:
        events.append(b'data: {"id":"x-1","choices":[],"system_fingerprint":"fp_9",'
                      b'"usage":{"prompt_tokens":7,"total_tokens":%d,"completion_tokens":%d}}'
                      b"\n\n" % (7 + count, count))
    if rng.random() < 0.85:
        events.append(b"data: [DONE]\n\n")
    return events


def random_script(rng: random.Random, events: list[bytes]) -> list[Any]:
    """The framed body in pieces, each written on its own: mostly one chunk per write, as vLLM
    writes, some split at a random byte (inside a size line or an event), some written
    together; often cut short by a close or a reset."""
    frames: list[bytes] = []
    i = 0
    while i < len(events):
        shape = rng.random()
        if shape < 0.08 and i + 1 < len(events):  # two events in one chunk
            frames.append(_frame(events[i] + events[i + 1]))
            i += 2
            continue
        if shape < 0.14 and len(events[i]) > 4:  # one event over two chunks
            cut = rng.randrange(1, len(events[i]))
            frames += [_frame(events[i][:cut]), _frame(events[i][cut:])]
        else:
            frames.append(_frame(events[i]))
        i += 1
    ending: Any = None
    if rng.random() < 0.75:
        frames.append(b"0\r\n\r\n")
    else:
        ending = rng.choice([CLOSE, RESET])
        if frames:  # cut at a random byte of a random chunk
            at = rng.randrange(len(frames))
            frames = [*frames[:at], frames[at][:rng.randrange(len(frames[at]) + 1)]]
    pieces: list[Any] = []
    for frame in frames:
        shape = rng.random()
        if shape < 0.12 and len(frame) > 1:
            cut = rng.randrange(1, len(frame))
            pieces += [frame[:cut], frame[cut:]]
        elif shape < 0.2 and pieces and isinstance(pieces[-1], bytes):
            pieces[-1] += frame
        elif frame:
            pieces.append(frame)
    if ending is not None:
        pieces.append(ending)
    elif rng.random() < 0.5:
        pieces.append(CLOSE)
    return pieces


ASKS = [
    {},  # usage cut: phasewatch asks for running usage and strips it
    {"stream_options": {"include_usage": True}},
    {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
]
# The stored figures that do not depend on when the bytes came.
FIELDS = ("outcome", "http_status", "output_tokens", "prompt_tokens", "tokens_exact",
          "itl_count", "error", "stream")


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptUpstream]:
    served = ScriptUpstream()
    yield served
    served.stop()


def _relay(proxy: Proxy, chat: bool, ask: dict[str, Any]) -> bytes:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "m", "stream": True, **ask}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    with httpx.stream("POST", proxy.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        return b"".join(response.iter_raw())


def test_random_streams_reach_the_client_and_the_record_alike(
        make_proxy: Callable[..., Proxy], upstream: ScriptUpstream) -> None:
    native = make_proxy(upstream.url, native_relay=True)
    python = make_proxy(upstream.url, native_relay=False)
    for case in range(CASES):
        rng = random.Random(case)
        chat = rng.random() < 0.5
        ask = rng.choice(ASKS)
        upstream.script = random_script(rng, random_events(rng, chat))
        got = _relay(native, chat, ask)
        expected = _relay(python, chat, ask)
        assert got == expected, f"case {case}: the client's bytes differ"
        mine, theirs = native.next_record(), python.next_record()
        assert {f: getattr(mine, f) for f in FIELDS} == {f: getattr(theirs, f) for f in FIELDS}, \
            f"case {case}: the records differ"

    # The native leg took part: most cases start with plain token chunks.
    assert native.sample("phasewatch_native_relay_streams_total") >= CASES // 2
    assert python.sample("phasewatch_native_relay_streams_total") == 0
