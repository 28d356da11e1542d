"""One streamed response, read by read: what to time, and what to forward to the client.

Pure and stateful like the SSE decoder it wraps: `feed(data, now_ns)` takes one read from the
upstream and the time it arrived, updates the request's timing, and returns the bytes to
forward for it; `end(now_ns)` returns what is left when the upstream's body ends. No I/O.

When phasewatch asked the upstream for usage the client did not want, the stream is forwarded
event by event with that usage cut out; otherwise each read is forwarded as it came.

Cutting the closing usage chunk would lose vLLM's `system_fingerprint`, which vLLM puts there
when usage is asked for and on the terminal chunk (finish_reason set) when it is not. So while
that chunk is to be cut, a terminal chunk is held until the next event (vLLM writes the usage
chunk right after it) and forwarded with the fingerprint spliced in, byte for byte what vLLM
would have sent. Timing is unaffected: every event is timed when its read arrives. (With n > 1
a terminal chunk followed by another choice's tokens goes out as it came: the fingerprint is
not known yet, and holding the chunk to the end would delay its choice.)
"""

from __future__ import annotations

from collections.abc import Iterable

from phasewatch.core.events import (
    EventInfo,
    Kind,
    add_fingerprint,
    classify,
    strip_usage,
    system_fingerprint,
)
from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.core.sse import SSEDecoder, event_data
from phasewatch.proxy._native import token_event
from phasewatch.proxy.request_plan import RequestPlan
from phasewatch.proxy.timing import Counting, StreamTiming

_COMMENT = EventInfo(Kind.OTHER)


class StreamFeed:
    __slots__ = ("_decoder", "_held", "_hold", "_record", "_rewrites", "_strip_chunk",
                 "_strip_final", "_timing", "done", "unterminated")

    def __init__(self, plan: RequestPlan, record: RequestRecord, timing: StreamTiming) -> None:
        self._decoder = SSEDecoder()
        self._record = record
        self._timing = timing
        self._strip_final = plan.strip_final_usage
        self._strip_chunk = plan.strip_chunk_usage
        self._rewrites = plan.strip_final_usage or plan.strip_chunk_usage
        self._hold = plan.strip_final_usage  # the usage chunk, and its fingerprint, will be cut
        self._held: list[bytes] = []  # terminal chunks waiting for the event after them
        self.done = False  # `data: [DONE]` has been read (and so forwarded with this read)
        self.unterminated = False  # the body ended inside an event

    def feed(self, data: bytes, now: int) -> bytes:
        """Time one read; return the bytes to forward for it (possibly empty)."""
        if (data.count(b"\n") == 2 and data.endswith(b"\n\n") and data.startswith(b"data: ")
                and b"\r" not in data and self._decoder.idle):
            # The usual read: exactly one whole one-line event (vLLM writes each chunk in one
            # piece). The splitter would return it unchanged, and its data is what follows
            # `data: `: skip both.
            if self._timing.counting is Counting.EXACT and not self._held:
                out = self._token_chunk(data, now)
                if out is not None:
                    return out
            info = self._note_data(data[6:-2], now)
            if info.kind is Kind.DONE:
                self.done = True
            if not self._rewrites:
                return data
            if info.kind is not Kind.USAGE and not info.finished and not self._held:
                # Nothing to hold or stamp: at most this chunk's running usage is cut.
                if self._strip_chunk and b'"usage":' in data:
                    return strip_usage(data)
                return data
            return self._rewrite(((data, info),))
        events = self._decoder.decode(data)
        if not self._rewrites:
            for raw in events:
                if self._note(raw, now).kind is Kind.DONE:
                    self.done = True
            return data
        return self._rewrite([(raw, self._note(raw, now)) for raw in events])

    @property
    def between_events(self) -> bool:
        """Nothing is held or half-read, and `[DONE]` has not come: the next read starts anew
        (so the native leg may take the stream from here, native.py)."""
        return not self._held and self._decoder.idle and not self.done

    @property
    def ended_whole(self) -> bool:
        """`[DONE]` has come and nothing is held or half-read: `end()` would add nothing."""
        return self.done and not self._held and self._decoder.idle

    def _token_chunk(self, data: bytes, now: int) -> bytes | None:
        """Time and forward one whole event that is a running chunk of an exactly counted
        stream, read from its bytes; None (nothing done) when it is not plainly one.

        Once a stream counts exactly, its time goes on its running usage alone (timing.py), so
        such a chunk needs no full parse: the native leg's reader (`token_event`, csrc/scan.c)
        says whether it is one (one choice, `"finish_reason":null`, no `error`, a compact
        `usage` object) and reads its counts; the native leg takes the same chunks by the same
        test. Anything else (the role chunk, a terminal chunk, the usage chunk, an error,
        spaced JSON) takes the general path, which agrees with it wherever both apply.
        """
        read = token_event(data)
        if read is None:
            return None
        completion, prompt, cut_from, cut_to = read
        timing = self._timing
        timing.completion_tokens = completion
        timing.prompt_tokens = prompt
        timing.event(now, completion, 0)
        return data[:cut_from] + data[cut_to:] if self._strip_chunk else data

    def _rewrite(self, events: Iterable[tuple[bytes, EventInfo]]) -> bytes:
        """The bytes to forward for these timed events, with usage the client did not ask for
        cut out and terminal chunks held for the fingerprint."""
        parts: list[bytes] = []
        for raw, info in events:
            kind = info.kind
            if kind is Kind.DONE:
                self.done = True
            if kind is Kind.USAGE:
                if self._held:
                    parts += _stamped(self._held, raw)
                    self._held = []
                if self._strip_final:
                    continue
            else:
                if self._strip_chunk and b'"usage":' in raw:
                    raw = strip_usage(raw)
                if self._hold:
                    if info.finished:
                        self._held.append(raw)
                        continue
                    if self._held:  # no usage chunk came next: nothing to stamp them with
                        parts += self._held
                        self._held = []
            parts.append(raw)
        return b"".join(parts) if len(parts) != 1 else parts[0]

    def end(self, now: int) -> bytes:
        """The body ended: what is still to forward (held chunks, an unterminated last event)."""
        out = b"".join(self._held)  # the stream ended right after a terminal chunk: as it came
        self._held = []
        for raw in self._decoder.flush():  # a last event without its blank line, or a broken one
            self.unterminated = True
            if self._note(raw, now).kind is Kind.DONE:
                self.done = True
            if self._rewrites:
                out += raw
        return out

    def _note(self, raw: bytes, now: int) -> EventInfo:
        """Update timing from one raw event; return what it is (OTHER for a comment-only one)."""
        data = event_data(raw)
        if data is None:
            return _COMMENT
        return self._note_data(data, now)

    def _note_data(self, data: bytes, now: int) -> EventInfo:
        """Update timing from one event's data."""
        info = classify(data)
        timing = self._timing
        if info.has_usage:
            timing.completion_tokens = info.completion_tokens
            timing.prompt_tokens = info.prompt_tokens
        kind = info.kind
        if kind is Kind.OUTPUT or (kind is Kind.EMPTY and info.completion_tokens):
            # Output, or an event without text whose running count says a token came (a
            # partial UTF-8 character): the timing decides which carries tokens.
            timing.event(now, info.completion_tokens, info.chars)
        elif kind is Kind.ERROR and self._record.outcome is Outcome.OK:
            self._record.outcome = Outcome.STREAM_ERROR
            self._record.error = "in-band error from upstream"
        return info


def _stamped(held: list[bytes], usage_event: bytes) -> list[bytes]:
    """Held terminal chunks with the usage chunk's fingerprint, where vLLM would have put it;
    unchanged when it has none (fingerprints off, or not a vLLM)."""
    fingerprint = system_fingerprint(usage_event)
    if fingerprint is None:
        return held
    return [add_fingerprint(raw, fingerprint) for raw in held]
