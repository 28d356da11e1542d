"""The SSE splitter, fed every way a stream can be cut into reads."""

from __future__ import annotations

import itertools

import pytest

from phasewatch.core.sse import SSEDecoder, event_data

LF_STREAM = (
    b'data: {"choices":[{"text":"a"}]}\n\n'
    b": keep-alive comment\n\n"
    b'data: {"choices":[{"text":"b\\nc"}]}\n\n'
    b"event: message\ndata: line one\ndata: line two\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED_DATA = [b'{"choices":[{"text":"a"}]}', None, b'{"choices":[{"text":"b\\nc"}]}',
                 b"line one\nline two", b"[DONE]"]


def _decode_in_pieces(stream: bytes, cuts: list[int]) -> list[bytes]:
    decoder = SSEDecoder()
    events: list[bytes] = []
    bounds = [0, *cuts, len(stream)]
    for start, end in itertools.pairwise(bounds):
        events += decoder.decode(stream[start:end])
    return events + decoder.flush()


@pytest.mark.parametrize("stream", [LF_STREAM, LF_STREAM.replace(b"\n", b"\r\n")],
                         ids=["lf", "crlf"])
def test_every_single_split_point_gives_the_same_events(stream: bytes) -> None:
    whole = _decode_in_pieces(stream, [])
    assert b"".join(whole) == stream  # raw events are the bytes as received
    assert [event_data(e) for e in whole] == EXPECTED_DATA
    for cut in range(1, len(stream)):
        assert _decode_in_pieces(stream, [cut]) == whole, f"split at byte {cut}"


def test_byte_by_byte_and_pairs_of_splits() -> None:
    stream = LF_STREAM.replace(b"\n", b"\r\n")
    whole = _decode_in_pieces(stream, [])
    assert _decode_in_pieces(stream, list(range(1, len(stream)))) == whole
    for a in range(1, len(stream), 7):
        for b in range(a + 1, len(stream), 11):
            assert _decode_in_pieces(stream, [a, b]) == whole


def test_event_completes_only_when_its_blank_line_arrives() -> None:
    decoder = SSEDecoder()
    assert decoder.decode(b"data: 1\n") == []
    assert decoder.decode(b"\n") == [b"data: 1\n\n"]
    assert decoder.decode(b"data: 2\r\n\r") == []  # a CR may be half of CRLF: wait
    assert decoder.decode(b"\n") == [b"data: 2\r\n\r\n"]


def test_unterminated_tail_is_returned_by_flush() -> None:
    decoder = SSEDecoder()
    assert decoder.decode(b'data: {"x":1}\n\ndata: {"y"') == [b'data: {"x":1}\n\n']
    assert decoder.flush() == [b'data: {"y"']
    assert decoder.flush() == []


def test_data_field_variants() -> None:
    assert event_data(b"data:no-space\n\n") == b"no-space"
    assert event_data(b"id: 4\ndata: x\n\n") == b"x"
    assert event_data(b": only a comment\n\n") is None
    assert event_data(b"data\n\n") == b""
