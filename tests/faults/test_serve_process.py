"""`phasewatch serve` as a process: its open-file limit (raised at start; a flood of streams
past what it allows gets 503s in the OpenAI format, never "Too many open files") and its log
(no access log, so no query strings, unless asked for).

Run as users run it (a subprocess of `python -m phasewatch.cli serve`) with its limit set before it
starts, in front of the scripted upstream.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson

from tests.support.servers import free_port, wait_http


@contextmanager
def serve(upstream: str, tmp_path: Path, soft: int, hard: int,
          **env: str) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    port = free_port()
    log = tmp_path / "serve.log"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "phasewatch.cli", "serve", "--port", str(port), "--upstream",
             upstream], stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit,
            env={**os.environ, "PHASEWATCH_DATABASE_URL":
                 f"sqlite+aiosqlite:///{tmp_path / 'pw.db'}", "PHASEWATCH_LOG_LEVEL": "info",
                 **env})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/api/health", proc=proc)
            yield url, proc, log
        finally:
            proc.terminate()
            proc.wait(timeout=15)


def open_files_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-files line")


def test_serve_raises_its_open_file_limit(scripted_url: str, tmp_path: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = min(hard, 8192)
    with serve(scripted_url, tmp_path, 256, hard) as (_, proc, log):
        assert open_files_limit(proc.pid) == hard
    text = log.read_text()
    assert f"open-file limit {hard}: up to {(hard - 64) // 4} client connections" in text


def test_a_flood_past_the_limit_gets_503s_not_too_many_open_files(
    scripted_url: str, tmp_path: Path
) -> None:
    streams = 60
    # 160 descriptors: (160 - 64) / 4 = 24 client connections (a stream in the native relay
    # holds four: client, upstream and a duplicate of each); 60 streams would need ~300.
    # Every stream is held open (its upstream would run 60 s) until all 60 have their answer,
    # so the 24 are all open at once however slowly the threads start.
    with serve(scripted_url, tmp_path, 160, 160) as (url, _, log):
        statuses: list[int] = []
        bodies: list[bytes] = []
        answered = threading.Semaphore(0)
        all_answered = threading.Event()

        def one() -> None:
            script = {"tokens": [[0.05, "a", 1], [60, "b", 1]]}
            body = b""
            try:
                with httpx.Client(timeout=30) as client, client.stream(
                    "POST", url + "/v1/completions",
                    headers={"x-script": orjson.dumps(script).decode()},
                    json={"model": "m", "prompt": "x", "stream": True},
                ) as response:
                    # Held in a name: a generator dropped after `break` would be closed, and
                    # httpx would close the connection with it.
                    chunks = response.iter_bytes()
                    for chunk in chunks:
                        body += chunk
                        if response.status_code != 200 or b'"text"' in body:
                            break  # refused (whole answer read), or streaming a token
                    statuses.append(response.status_code)
                    bodies.append(body)
                    answered.release()
                    all_answered.wait(60)
            except httpx.HTTPError as exc:
                statuses.append(-1)
                bodies.append(repr(exc).encode())
                answered.release()

        threads = [threading.Thread(target=one) for _ in range(streams)]
        for thread in threads:
            thread.start()
        for _ in range(streams):
            assert answered.acquire(timeout=60)
        all_answered.set()
        for thread in threads:
            thread.join()
        text = log.read_text()
    assert "Too many open files" not in text
    refused = [b for s, b in zip(statuses, bodies, strict=True) if s == 503]
    assert statuses.count(200) + len(refused) == streams, statuses
    assert 20 <= statuses.count(200) <= 24, (statuses, text[-3000:])
    for body in refused:
        assert orjson.loads(body)["error"]["type"] == "service_unavailable"
    assert "connection limit 25 reached" in text


def test_the_log_has_no_query_strings_by_default(scripted_url: str, tmp_path: Path) -> None:
    with serve(scripted_url, tmp_path, 1024, 1024) as (url, _, log):
        assert httpx.get(url + "/v1/models?api_key=s3cret-in-query").status_code == 200
        assert httpx.get(url + "/api/health?token=s3cret-too").status_code == 200
    text = log.read_text()
    assert "s3cret" not in text and "/v1/models" not in text
