"""The admin API's errors are always JSON in the OpenAI format: a database that fails answers
503, a parameter the database cannot take answers 422; neither logs a traceback, and neither
touches a client's stream."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from phasewatch.store.migrate import upgrade
from tests.conftest import Proxy
from tests.support.databases import PrivatePostgres

SCRIPT = {"x-script": '{"tokens": [[0.01, "a", 1], [0.02, "b", 1]]}'}


def stream_ok(proxy: Proxy) -> None:
    response = httpx.post(proxy.url + "/v1/completions", headers=SCRIPT,
                          json={"model": "scripted", "prompt": "x", "stream": True})
    assert response.status_code == 200 and response.content.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("path", ["/api/requests", "/api/stats", "/api/diagnosis"])
def test_a_nul_in_a_parameter_is_a_422(make_proxy: Any, scripted_url: str, database_url: str,
                                       path: str) -> None:
    proxy = make_proxy(scripted_url, database_url=database_url)
    response = httpx.get(proxy.url + path, params={"model": "a\x00b"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "NUL" in error["message"]


def test_a_failing_database_answers_503_and_streams_go_on(
    make_proxy: Any, scripted_url: str, private_postgres: PrivatePostgres,
    caplog: pytest.LogCaptureFixture
) -> None:
    upgrade(private_postgres.url)
    proxy = make_proxy(scripted_url, database_url=private_postgres.url)
    stream_ok(proxy)
    proxy.next_record()
    private_postgres.stop()
    for api in ("/api/requests", "/api/stats", "/api/runs"):
        response = httpx.get(proxy.url + api)
        assert response.status_code == 503, (api, response.text)
        assert response.json()["error"]["type"] == "database_unavailable"
    stream_ok(proxy)  # the relay never waits on the database
    assert not [r for r in caplog.records if r.exc_info]  # one line each, no traceback
