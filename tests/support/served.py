"""Talking to `phasewatch serve` run as a subprocess (several workers, several replicas): which
process answered, its `/metrics` as numbers, and streams held open on a known worker."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")

Series = tuple[str, tuple[tuple[str, str], ...]]


def parse_metrics(text: str) -> dict[Series, float]:
    """Every sample of a /metrics page by (name, sorted labels); a series twice is an error."""
    found: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in found, f"series {key} appears twice"
            found[key] = sample.value
    return found


def total(samples: dict[Series, float], name: str, **labels: str) -> float:
    """The sum of `name` over its series that carry `labels`."""
    return sum(value for (found, series), value in samples.items()
               if found == name and set(labels.items()) <= set(series))


def wait_for(condition: Callable[[], T | None], timeout: float = 30.0,
             says: str = "condition") -> T:
    """Poll until `condition()` returns something truthy, and return it."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{says}: not met within {timeout} s")
        time.sleep(0.05)


@dataclass(frozen=True, slots=True)
class Answer:
    pid: int  # the worker that answered
    role: str  # its leadership role
    response: httpx.Response


def ask(url: str, method: str = "GET", path: str = "/metrics", **kwargs: Any) -> Answer:
    """`path` on a new connection, after `/api/health` on that same connection: so the answer
    comes with the pid of the worker that gave it."""
    with httpx.Client(base_url=url, timeout=30) as client:
        health = client.get("/api/health").json()
        return Answer(health["pid"], health["role"], client.request(method, path, **kwargs))


def script(*tokens: tuple[float, str]) -> dict[str, str]:
    """The scripted upstream's header for a stream of these (time, text) tokens."""
    return {"x-script": orjson.dumps({"tokens": [[at, text, 1] for at, text in tokens]})
            .decode()}


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class OpenStream:
    """A streamed completion held open on one worker (whose pid it knows) until closed."""

    def __init__(self, url: str, last_token_at: float) -> None:
        self.client = httpx.Client(base_url=url, timeout=60)
        self.pid = int(self.client.get("/api/health").json()["pid"])
        request = self.client.build_request(
            "POST", "/v1/chat/completions", json=CHAT,
            headers=script((0.0, "a"), (last_token_at, "b")))
        self.response = self.client.send(request, stream=True)
        assert self.response.status_code == 200

    def close(self) -> None:
        try:
            self.response.close()
        except httpx.HTTPError:
            pass  # its worker is gone
        self.client.close()
