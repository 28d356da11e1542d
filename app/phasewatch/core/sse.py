"""Incremental server-sent-events splitter: bytes in, complete raw events out.

Pure and stateful, in the manner of httpx's decoders: `decode(chunk)` returns the events that
the chunk completed (each with its terminating blank line, byte for byte as received) and keeps
the unfinished tail; `flush()` returns that tail when the stream ends. It does no I/O and no
JSON parsing; `event_data` pulls the `data:` payload out of one raw event.
"""

from __future__ import annotations

import re

# A blank line ends an event. A line ends with CRLF, LF or CR (SSE spec); "\r\n" is one ending.
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_LINE_SPLIT = re.compile(rb"\r\n|\r|\n")


class SSEDecoder:
    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def decode(self, chunk: bytes) -> list[bytes]:
        buf = self._tail + chunk if self._tail else chunk
        events: list[bytes] = []
        start = 0
        if b"\r" not in buf:  # LF-only, as vLLM and OpenAI send: plain searches, no regex
            end = buf.find(b"\n\n")
            while end >= 0:
                events.append(buf[start:end + 2])
                start = end + 2
                end = buf.find(b"\n\n", start)
            self._tail = buf[start:]
            return events
        for match in _EVENT_END.finditer(buf):
            end = match.end()
            # A lone trailing "\r" may be the first half of a "\r\n" still in flight: wait for it.
            if end == len(buf) and buf.endswith(b"\r") and not buf.endswith(b"\r\r"):
                break
            events.append(buf[start:end])
            start = end
        self._tail = buf[start:]
        return events

    @property
    def idle(self) -> bool:
        """No unfinished event is waiting for more bytes."""
        return not self._tail

    def flush(self) -> list[bytes]:
        """The unterminated last event, if the stream ended without a blank line."""
        tail, self._tail = self._tail, b""
        return [tail] if tail.strip() else []


def event_data(raw: bytes) -> bytes | None:
    """The `data` field of one raw event (multi-line data joined with LF), or None if absent."""
    if raw.startswith(b"data: ") and raw.count(b"\n") <= 2 and b"\r" not in raw:
        # Fast path: one `data: ...` line, as vLLM and OpenAI send.
        return raw[6:].rstrip(b"\n")
    parts: list[bytes] = []
    for line in _LINE_SPLIT.split(raw):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            parts.append(b"")
    return b"\n".join(parts) if parts else None
