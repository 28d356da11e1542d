"""The admin surface is closed by default: records, runs, stats, diagnosis and the API docs
answer only callers with the admin token (or everyone, when opened on purpose), and a run id is
honoured only from such a caller. Inference, the upstream's other routes, liveness, readiness
and /metrics stay open. Real proxy under uvicorn, scripted upstream."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import Proxy
from tests.support.served import wait_for

ADMIN = ("/api/requests", "/api/stats", "/api/runs", "/api/diagnosis", "/docs", "/openapi.json")
OPEN = ("/api/health", "/api/ready", "/metrics", "/v1/models")
TOKEN = "s3cret-admin-token"


def stream(proxy: Proxy, request_id: str, **headers: str) -> None:
    response = httpx.post(proxy.url + "/v1/completions",
                          headers={"x-request-id": request_id, **headers},
                          json={"model": "scripted", "prompt": "x", "stream": True})
    assert response.status_code == 200


def test_closed_by_default_and_says_how_to_open(make_proxy: Any, scripted_url: str) -> None:
    proxy = make_proxy(scripted_url, admin_open=False)  # the default (tests open it elsewhere)
    for path in ADMIN:
        response = httpx.get(proxy.url + path)
        assert response.status_code == 403, path
        message = response.json()["error"]["message"]
        assert "PHASEWATCH_ADMIN_TOKEN" in message and "PHASEWATCH_ADMIN_OPEN" in message
    for path in OPEN:
        assert httpx.get(proxy.url + path).status_code == 200, path
    stream(proxy, "closed")  # inference is not admin
    # The request is counted as it is finished, just after its last byte reached the client.
    labels = {"model": "scripted", "endpoint": "completions", "outcome": "ok"}
    wait_for(lambda: proxy.sample("phasewatch_requests_total", labels), says="counted")
    assert proxy.sample("phasewatch_requests_total", labels) == 1


@pytest.fixture
def guarded(make_proxy: Any, scripted_url: str) -> Proxy:
    return make_proxy(scripted_url, admin_open=False, admin_token=TOKEN)


def test_the_token_opens_it_and_a_wrong_one_does_not(guarded: Proxy) -> None:
    for path in ADMIN:
        assert httpx.get(guarded.url + path).status_code == 401, path
        assert httpx.get(guarded.url + path, headers={
            "x-phasewatch-admin-token": "wrong"}).status_code == 401, path
        assert httpx.get(guarded.url + path, headers={
            "x-phasewatch-admin-token": TOKEN}).status_code == 200, path
        assert httpx.get(guarded.url + path, headers={
            "authorization": f"Bearer {TOKEN}"}).status_code == 200, path


def test_a_run_id_is_honoured_only_with_the_token(guarded: Proxy, scripted_url: str) -> None:
    admin = {"x-phasewatch-admin-token": TOKEN}
    stream(guarded, "anyone", **{"x-phasewatch-run-id": "bench-1"})
    stream(guarded, "bearer-only", **{"x-phasewatch-run-id": "bench-1",
                                      "authorization": f"Bearer {TOKEN}"})  # the upstream's key
    stream(guarded, "admin", **{"x-phasewatch-run-id": "bench-1"}, **admin)

    def stored() -> dict[str, str | None]:
        rows = httpx.get(guarded.url + "/api/requests", headers=admin, params={"limit": 10})
        return {row["request_id"]: row["run_id"] for row in rows.json()["items"]}

    runs = wait_for(lambda: len(found := stored()) == 3 and found, says="three records")
    assert runs == {"anyone": None, "bearer-only": None, "admin": "bench-1"}
    log = httpx.get(scripted_url + "/_log/admin").json()
    assert "x-phasewatch-admin-token" not in log["headers"]  # never sent upstream
    assert log["headers"].get("authorization") is None
    bearer = httpx.get(scripted_url + "/_log/bearer-only").json()
    assert bearer["headers"]["authorization"] == f"Bearer {TOKEN}"  # the client's, forwarded
