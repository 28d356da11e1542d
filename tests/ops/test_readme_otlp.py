"""README's "OpenTelemetry (OTLP)" setup, run as a reader would copy it.

Its ```sh block is executed line by line: the `pip install` must name the `otel` extra (this
environment has it), each `export` becomes the server's environment (the collector address
pointed at a receiver on loopback), and its `phasewatch serve` runs as a subprocess (upstream:
the scripted one). Streams go through; SIGTERM must end the process cleanly and flush the last
export, which must hold the GenAI metrics and a span per request under the README's service name.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.otlp_receiver import OtlpReceiver, Received
from tests.support.readme import blocks
from tests.support.servers import free_port, subprocess_server


def test_the_readme_otlp_setup_exports_metrics_and_spans(scripted_url: str,
                                                         tmp_path: Path) -> None:
    (setup,) = blocks("OpenTelemetry (OTLP)", "sh")
    env: dict[str, str] = {"PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'pw.db'}",
                           "PHASEWATCH_LOG_LEVEL": "warning"}
    serve: list[str] = []
    with OtlpReceiver() as receiver:
        for line in setup.splitlines():
            words = shlex.split(line)
            if words[:2] == ["pip", "install"]:
                assert words[2:] == ["phasewatch[otel]"]
            elif words[0] == "export":
                name, value = words[1].split("=", 1)
                env[name] = receiver.url if name == "OTEL_EXPORTER_OTLP_ENDPOINT" else value
            else:
                assert words[:2] == ["phasewatch", "serve"], line
                serve = words[2:]
        assert env["PHASEWATCH_OTEL_ENABLED"] == "true" and "OTEL_EXPORTER_OTLP_ENDPOINT" in env
        upstream = serve.index("--upstream")
        serve[upstream + 1] = scripted_url
        port = free_port()
        args = ["-m", "phasewatch.cli", "serve", *serve, "--port", str(port)]
        url = f"http://127.0.0.1:{port}"
        with subprocess_server(args, url + "/api/health", env=env) as proc:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            for _ in range(2):
                with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                                  timeout=30) as response:
                    assert response.status_code == 200 and b"[DONE]" in response.read()
            proc.terminate()  # SIGTERM: drains, then flushes the last export
            # uvicorn re-raises the signal it handled, once shut down
            assert proc.wait(timeout=30) in (0, -signal.SIGTERM)

        def exported(received: Received) -> bool:
            metrics = received.last_metrics()
            return ("gen_ai.server.time_to_first_token" in metrics
                    and len(received.spans()) == 2)

        received = receiver.wait(exported, timeout=10, says="the shutdown's export")
    metric, resource = received.last_metrics()["gen_ai.server.time_to_first_token"]
    assert resource["service.name"] == env["OTEL_SERVICE_NAME"]
    assert sum(point.count for point in metric.histogram.data_points) == 2
    assert {span.name for span, _ in received.spans()} == {"chat m"}


def test_serve_refuses_what_it_cannot_export(tmp_path: Path) -> None:
    """The switch with gRPC asked for: a sentence and exit 2, before anything starts."""
    done = subprocess.run(
        [sys.executable, "-m", "phasewatch.cli", "serve"], capture_output=True, text=True,
        timeout=60, env={"PATH": "/usr/bin:/bin", "PHASEWATCH_OTEL_ENABLED": "true",
                         "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                         "PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/pw.db"})
    assert done.returncode == 2
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=grpc" in done.stderr and "http/protobuf" in done.stderr
