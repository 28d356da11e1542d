"""A raw streaming client for the real-vLLM tests: every SSE event with the time it completed.

The official `openai` client is used where the test is about what a user's code sees; this one
where the test needs each event's bytes and arrival time (`time.perf_counter()` in this
process, taken when the read that completed the event returned).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson


@dataclass
class Event:
    at: float  # perf_counter() when the read completing this event returned
    data: bytes  # the `data:` payload

    def json(self) -> Any:
        return orjson.loads(self.data)


@dataclass
class StreamResult:
    sent: float  # perf_counter() just before the request was sent
    status: int
    events: list[Event] = field(default_factory=list)
    body: bytes = b""  # the whole response, as received

    @property
    def chunks(self) -> list[dict[str, Any]]:
        """Every JSON event (not `[DONE]`)."""
        return [e.json() for e in self.events if e.data != b"[DONE]"]

    def output_times(self) -> list[float]:
        """Arrival time of each event that carries output text (not role-only, not usage)."""
        return [e.at for e in self.events if e.data != b"[DONE]" and output_text(e.json())]

    def text(self) -> str:
        return "".join(output_text(chunk) for chunk in self.chunks)


def output_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def stream(base_url: str, path: str, body: dict[str, Any], timeout: float = 120.0
           ) -> StreamResult:
    """POST a streamed request; return each event as it completed."""
    pending = b""
    with httpx.Client(timeout=timeout) as client:
        sent = time.perf_counter()
        with client.stream("POST", base_url + path, json={**body, "stream": True}) as response:
            result = StreamResult(sent, response.status_code)
            for data in response.iter_raw():
                now = time.perf_counter()
                result.body += data
                pending += data
                while b"\n\n" in pending:
                    raw, pending = pending.split(b"\n\n", 1)
                    for line in raw.split(b"\n"):
                        if line.startswith(b"data:"):
                            result.events.append(Event(now, line[5:].strip()))
    return result


def token_prompt(n: int, seed: int) -> list[int]:
    """A prompt of exactly n token ids, distinct per seed, avoiding the special tokens (0-2)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]


def text_prompt(words: int, seed: int) -> str:
    """Plain words for chat prompts (their token count comes back in usage)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar",
                                "sierra", "tango", "zulu", "seven", "ninety"])
                    for _ in range(words))
