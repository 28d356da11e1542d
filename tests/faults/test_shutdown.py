"""Stopping `phasewatch serve`: bounded in time, every stream told why it ended, every record
stored.

Run as users run it (`python -m phasewatch.cli serve`, a subprocess, its own SQLite file) in front
of the scripted upstream, with streams that would run for a minute. Every wait is on a condition.
"""

from __future__ import annotations

import http.client
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson

from tests.support.served import parse_metrics, total, wait_for
from tests.support.servers import free_port, wait_http

LONG = {"x-script": orjson.dumps({"tokens": [[0.05, "a", 1], [60.0, "b", 1]]}).decode()}


@contextmanager
def serving(upstream: str, db: Path,
            grace_s: float) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "phasewatch.cli", "serve", "--port", str(port),
         "--upstream", upstream],
        env={**os.environ, "PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{db}",
             "PHASEWATCH_SHUTDOWN_GRACE_S": str(grace_s), "PHASEWATCH_LOG_LEVEL": "warning"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/api/health", proc=proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Streams:
    """`n` streams held open through the proxy, each read to its end in a thread."""

    def __init__(self, url: str, n: int) -> None:
        self.bodies: list[bytes] = []
        self.threads = [threading.Thread(target=self._one, args=(url,)) for _ in range(n)]
        for thread in self.threads:
            thread.start()
        wait_for(lambda: total(parse_metrics(httpx.get(url + "/metrics").text),
                               "phasewatch_requests_in_flight") == n, says="streams open")

    def _one(self, url: str) -> None:
        body = b""
        try:
            with httpx.stream("POST", url + "/v1/completions", headers=LONG, timeout=120,
                              json={"model": "m", "prompt": "x", "stream": True}) as response:
                for data in response.iter_raw():
                    body += data
        except httpx.HTTPError as exc:
            body += f"\nclient error: {exc!r}".encode()
        self.bodies.append(body)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=30)


def not_ready(url: str) -> bool:
    try:
        return httpx.get(url + "/api/ready", timeout=2).status_code == 503
    except httpx.TransportError:
        return True  # no longer accepting connections: not ready either


def outcomes(db: Path) -> list[tuple[str, str | None]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT outcome, error FROM requests").fetchall()


def assert_ended_with_an_error_event(bodies: list[bytes]) -> None:
    for body in bodies:
        assert body.endswith(b"data: [DONE]\n\n"), body[-300:]
        assert b"phasewatch shut down before the stream ended" in body, body[-300:]
        assert b'"service_unavailable"' in body


def test_sigterm_drains_within_the_grace_then_ends_streams_and_stores_every_record(
    scripted_url: str, tmp_path: Path
) -> None:
    db = tmp_path / "pw.db"
    grace = 2.0
    with serving(scripted_url, db, grace) as (url, proc):
        streams = Streams(url, 50)
        assert httpx.get(url + "/api/ready").status_code == 200
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not_ready(url), timeout=grace, says="readiness fails at once")
        proc.wait(timeout=grace + 10)
        elapsed = time.monotonic() - started
        streams.join()
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert grace <= elapsed < grace + 8, elapsed
    assert len(streams.bodies) == 50
    assert_ended_with_an_error_event(streams.bodies)
    stored = outcomes(db)
    assert len(stored) == 50  # every request, nothing lost
    assert {outcome for outcome, _ in stored} == {"shutdown"}


def test_a_second_signal_ends_the_streams_at_once_and_still_flushes(
    scripted_url: str, tmp_path: Path
) -> None:
    db = tmp_path / "pw.db"
    with serving(scripted_url, db, grace_s=300) as (url, proc):
        streams = Streams(url, 5)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not_ready(url), says="draining")
        assert proc.poll() is None  # draining: the streams may still end by themselves
        proc.send_signal(signal.SIGINT)  # the second: do not wait for the grace
        proc.wait(timeout=10)
        streams.join()
    assert time.monotonic() - started < 10
    assert_ended_with_an_error_event(streams.bodies)
    assert len(outcomes(db)) == 5


def _kept(url: str, script: dict[str, object]) -> tuple[http.client.HTTPConnection, bytes]:
    """A connection whose first request ended (kept alive), then `script` asked on it."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = orjson.dumps({"model": "m", "prompt": "x", "stream": True})
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    first = conn.getresponse().read()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json",
                                                    "x-script": orjson.dumps(script).decode()})
    return conn, first


def test_sigterm_ends_the_streams_the_native_leg_holds_and_closes_idle_kept_connections(
    scripted_url: str, tmp_path: Path
) -> None:
    """Streams the native leg holds on kept connections drain and end as any (an error event at
    the grace's end, a record each), and kept connections idle between requests are closed, so
    that the process stops within its grace."""
    db = tmp_path / "pw.db"
    grace = 2.0
    with serving(scripted_url, db, grace) as (url, proc):
        running = [_kept(url, {"tokens": [[0.05, "a", 1], [60.0, "b", 1]]}) for _ in range(4)]
        wait_for(lambda: total(parse_metrics(httpx.get(url + "/metrics").text),
                               "phasewatch_native_relay_streams_total") >= 8,
                 says="the native leg took the streams")
        idle = [_kept(url, {"tokens": [[0.01, "a", 1]]}) for _ in range(3)]
        for conn, _ in idle:
            conn.getresponse().read()  # answered; the connection then idles
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        bodies = [conn.getresponse().read() for conn, _ in running]
        for conn, _ in idle:
            assert conn.sock is not None and conn.sock.recv(1) == b""  # closed by the server
        proc.wait(timeout=grace + 10)
        elapsed = time.monotonic() - started
    assert grace <= elapsed < grace + 8, elapsed
    assert_ended_with_an_error_event(bodies)
    stored = outcomes(db)
    assert len(stored) == 4 + 4 + 3 + 3
    assert sorted(outcome for outcome, _ in stored).count("shutdown") == 4
