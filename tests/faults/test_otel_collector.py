"""An OpenTelemetry collector that accepts connections and never answers.

`phasewatch serve` with OpenTelemetry on and its collector hung: every stream must still be
relayed whole (the exporters work on their own threads), and after SIGTERM the process must
exit within its shutdown bounds, the last export abandoned (with a warning) after
`PHASEWATCH_SHUTDOWN_FLUSH_S` rather than holding the process for the exporter's own timeout
and retries.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.servers import free_port, subprocess_server

FLUSH_S = 1
EXPORTER_TIMEOUT_S = 20  # what a hung export would otherwise hold the process for, at least


@pytest.fixture
def hung_collector() -> Iterator[str]:
    """A listening socket that accepts and never reads or answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_streams_flow_and_exit_is_bounded_with_a_hung_collector(
        scripted_url: str, hung_collector: str, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"PHASEWATCH_OTEL_ENABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": hung_collector,
           "OTEL_EXPORTER_OTLP_TIMEOUT": str(EXPORTER_TIMEOUT_S),
           "OTEL_METRIC_EXPORT_INTERVAL": "200", "OTEL_BSP_SCHEDULE_DELAY": "50",
           "PHASEWATCH_SHUTDOWN_FLUSH_S": str(FLUSH_S), "PHASEWATCH_LOG_LEVEL": "warning",
           "PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'pw.db'}"}
    args = ["-m", "phasewatch.cli", "serve", "--upstream", scripted_url, "--port", str(port)]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    script = orjson.dumps({"tokens": [[0.01 * k, "t", 1] for k in range(1, 21)]}).decode()
    with subprocess_server(args, url + "/api/health", env=env) as proc:
        for _ in range(5):
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30,
                              headers={"x-script": script}) as response:
                assert response.status_code == 200
                events = response.read().count(b"data: ")
            assert events == 1 + 20 + 1 + 1  # role, tokens, terminal chunk, [DONE]
        started = time.monotonic()
        proc.terminate()
        # uvicorn re-raises the signal it handled, once shut down
        assert proc.wait(timeout=EXPORTER_TIMEOUT_S) in (0, -signal.SIGTERM)
        stopped_in = time.monotonic() - started
    # The flush bound, plus starting and ending the interpreter's shutdown (about a second).
    assert stopped_in < FLUSH_S + 4, f"exit took {stopped_in:.1f} s"
