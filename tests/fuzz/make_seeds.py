"""Writes the fuzz targets' seed corpus (tests/fuzz/corpus/): the streams vLLM sends.

Run from the repository root: `python tests/fuzz/make_seeds.py`. Its output is committed; the
fuzzers grow their own corpus in build/fuzz/ from it (`make fuzz`).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import orjson

CORPUS = Path(__file__).parent / "corpus"


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _usage(completion: int) -> dict[str, int]:
    return {"prompt_tokens": 7, "total_tokens": 7 + completion, "completion_tokens": completion}


def _chat(content: str | None, completion: int, finish: str | None = None,
          role: bool = False) -> bytes:
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    return _event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                   "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}],
                   "usage": _usage(completion)})


def _text(text: str, completion: int, finish: str | None = None) -> bytes:
    return _event({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                   "choices": [{"index": 0, "text": text, "logprobs": None,
                                "finish_reason": finish}], "usage": _usage(completion)})


def _closing(completion: int) -> bytes:
    return _event({"id": "cmpl-1", "choices": [], "system_fingerprint": "fp_1",
                   "usage": _usage(completion)})


DONE = b"data: [DONE]\n\n"


def streams() -> dict[str, list[bytes]]:
    chat = [_chat(None, 0, role=True)] + [_chat(f"t{i}", i) for i in range(1, 6)]
    text = [_text(f"t{i}", i) for i in range(1, 6)]
    return {
        "chat": [*chat, _chat("", 5, finish="stop"), _closing(5), DONE],
        "text": [*text, _text("", 5, finish="length"), _closing(5), DONE],
        "several-tokens": [_text("ab", 2), _text("cde", 5), _text("", 5, "stop"), DONE],
        "error": [_text("t1", 1), _event({"error": {"message": "x", "code": 500}}), DONE],
        "spaced": [b'data: {"choices": [{"text": "a", "finish_reason": null}], '
                   b'"usage": {"completion_tokens": 1}}\n\n', DONE],
    }


def main() -> None:
    for target in ("take", "event", "replay"):
        (CORPUS / target).mkdir(parents=True, exist_ok=True)
    for name, events in streams().items():
        body = b"".join(_frame(e) for e in events) + b"0\r\n\r\n"
        for flags in (0, 3, 4, 7):  # strip/hold/pending
            (CORPUS / "take" / f"{name}-{flags}").write_bytes(bytes((flags, 17)) + body)
        for i, event in enumerate(events[:3]):
            (CORPUS / "event" / f"{name}-{i}").write_bytes(event)
    for name, triples in {"steady": [(10**6 * i, i, 7) for i in range(1, 9)],
                          "jumps": [(5, 3, -1), (9, 3, -1), (20, 40, 7), (21, 1 << 25, 7)]}.items():
        head = struct.pack("<qq", 0, 0)
        (CORPUS / "replay" / name).write_bytes(
            head + b"".join(struct.pack("<qqq", *t) for t in triples))


if __name__ == "__main__":
    main()
