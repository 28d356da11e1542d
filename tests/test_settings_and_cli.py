"""Configuration fails early and clearly; the `phasewatch` command runs the proxy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from phasewatch.core import settings_doc
from phasewatch.core.settings import Settings, SettingsError, load_settings
from tests.support.servers import free_port, subprocess_server, wait_http

ROOT = Path(__file__).resolve().parent.parent


def test_the_configuration_page_is_the_settings_model() -> None:
    """docs/configuration.md is generated from the model (`make configuration`): a setting
    added, removed, renamed, re-defaulted or re-described without it fails here."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == settings_doc.render(), "docs/configuration.md is stale: run make configuration"
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no docstring in settings.py"
        assert f"`{settings_doc.variable(name, field)}`" in page
    assert settings_doc.SECTIONS[0][1] == next(iter(Settings.model_fields))


def test_defaults_need_no_configuration() -> None:
    settings = load_settings()
    assert settings.upstream_base == "http://127.0.0.1:8000"
    assert (settings.slo_ttft_s, settings.slo_itl_s) == (0.5, 0.04)


def test_environment_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHASEWATCH_UPSTREAM_URL", "http://10.1.2.3:9000/")
    monkeypatch.setenv("PHASEWATCH_SLO_ITL_S", "0.05")
    settings = load_settings()
    assert settings.upstream_base == "http://10.1.2.3:9000" and settings.slo_itl_s == 0.05


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [("PHASEWATCH_UPSTREAM_URL", "not a url", "PHASEWATCH_UPSTREAM_URL='not a url' is invalid"),
     ("PHASEWATCH_PORT", "70000", "PHASEWATCH_PORT='70000' is invalid"),
     ("PHASEWATCH_SLO_TTFT_S", "-1", "PHASEWATCH_SLO_TTFT_S='-1' is invalid"),
     ("PHASEWATCH_LOG_LEVEL", "loud", "Input should be 'critical', 'error'"),
     ("PHASEWATCH_WORKERS", "0", "PHASEWATCH_WORKERS='0' is invalid"),
     ("PROMETHEUS_MULTIPROC_DIR", " ", "PROMETHEUS_MULTIPROC_DIR=' ' is invalid: Value error")],
)
def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, variable: str, value: str,
                                      says: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=says.replace("(", r"\(")):
        load_settings()


def test_serve_refuses_bad_configuration_with_a_sentence() -> None:
    env = {**os.environ, "PHASEWATCH_UPSTREAM_URL": "nope"}
    result = subprocess.run([sys.executable, "-m", "phasewatch.cli", "serve"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "invalid configuration: PHASEWATCH_UPSTREAM_URL='nope' is invalid" in result.stderr


def test_serve_runs_the_proxy(scripted_url: str, tmp_path: Path) -> None:
    port = free_port()
    args = ["-m", "phasewatch.cli", "serve", "--upstream", scripted_url, "--port", str(port)]
    with subprocess_server(args, f"http://127.0.0.1:{port}/api/health", env={
            "PHASEWATCH_LOG_LEVEL": "warning",
            "PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'pw.db'}"}):
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "scripted"
        assert len(models.headers.get_list("date")) <= 1
        assert "phasewatch_requests_in_flight" in httpx.get(f"http://127.0.0.1:{port}/metrics").text


def test_serve_runs_where_uvloop_is_not_installed(scripted_url: str, tmp_path: Path) -> None:
    """Without uvloop (Windows, PyPy) `serve` runs on asyncio's own loop and says so."""
    port = free_port()
    launcher = ("import sys; sys.modules['uvloop'] = None; from phasewatch.cli import main; "
                f"sys.exit(main(['serve', '--upstream', {scripted_url!r}, '--port', '{port}']))")
    log = tmp_path / "serve.log"
    env = {**os.environ, "PHASEWATCH_LOG_LEVEL": "info",
           "PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'pw.db'}"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", launcher], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            wait_http(f"http://127.0.0.1:{port}/api/health", proc=proc)
            script = {"x-script": '{"tokens": [[0.01, "a", 1], [0.02, "b", 1]]}'}
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=script,
                                json={"model": "scripted", "prompt": "x", "stream": True})
            assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    text = log.read_text()
    assert "asyncio event loop (uvloop is not installed), httptools HTTP parser" in text, text


def test_a_postgres_url_without_its_driver_says_what_to_install() -> None:
    launcher = ("import sys; sys.modules['asyncpg'] = None; from phasewatch.cli import main; "
                "sys.exit(main(['serve']))")
    env = {**os.environ,
           "PHASEWATCH_DATABASE_URL": "postgresql+asyncpg://postgres@127.0.0.1:5432/test"}
    done = subprocess.run([sys.executable, "-c", launcher], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "pip install 'phasewatch[postgres]'" in done.stderr


def test_each_served_process_holds_streams_back_briefly(tmp_path: Path) -> None:
    """`serve`'s app factory shortens CPython's switch interval (5 ms by default), so a
    background thread computing (the diagnosis's statistics) holds no chunk back for long; runs
    the cyclic collector's full collections, which walk every request in flight, ten times
    less often; and its youngest generation after 10,000 allocations instead of 700."""
    code = ("import gc, sys; from phasewatch.main import SWITCH_INTERVAL_S, serve_app; "
            "before = sys.getswitchinterval(), gc.get_threshold(); serve_app(); "
            "print(before[0], sys.getswitchinterval(), SWITCH_INTERVAL_S, *before[1], "
            "*gc.get_threshold())")
    env = {**os.environ, "PHASEWATCH_LOG_LEVEL": "warning",
           "PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'pw.db'}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    before, after, wanted = map(float, out[:3])
    assert before == 0.005 and after == wanted <= 0.001
    assert [int(n) for n in out[3:]] == [700, 10, 10, 10_000, 10, 100]
