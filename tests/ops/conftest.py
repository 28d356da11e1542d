"""Fixtures for the operations tests: the real Prometheus binaries, and the repository's paths.

promtool and prometheus come from Debian's `prometheus` package (.ci/run installs it). In CI
(CI=true) a missing binary fails the test with a sentence saying so; elsewhere it skips.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SLO_FILE = DEPLOY / "slo.yaml"


def require_binary(name: str) -> str:
    found = shutil.which(name)
    if found is None and Path(f"/usr/bin/{name}").exists():
        found = f"/usr/bin/{name}"
    if found is not None:
        return found
    message = f"{name} is not installed: it comes from Debian's `prometheus` package (.ci/run " \
        "installs it with apt)"
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return require_binary("prometheus")
