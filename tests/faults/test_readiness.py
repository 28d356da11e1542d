"""Readiness (`/api/ready`) follows the record writer: it fails once records have not been
stored for `PHASEWATCH_READY_WRITER_FAILING_S`, and recovers with the database. Liveness
(`/api/health`) does not move."""

from __future__ import annotations

from typing import Any

import httpx

from phasewatch.store.migrate import upgrade
from tests.support.databases import PrivatePostgres
from tests.support.served import wait_for

SCRIPT = {"x-script": '{"tokens": [[0.01, "a", 1]]}'}


def test_readiness_fails_while_records_cannot_be_stored(
    make_proxy: Any, scripted_url: str, private_postgres: PrivatePostgres
) -> None:
    upgrade(private_postgres.url)
    proxy = make_proxy(scripted_url, database_url=private_postgres.url,
                       ready_writer_failing_s=0.5)
    assert httpx.get(proxy.url + "/api/ready").json() == {"status": "ready"}
    private_postgres.stop()
    httpx.post(proxy.url + "/v1/completions", headers=SCRIPT,
               json={"model": "m", "prompt": "x", "stream": True}).raise_for_status()
    answer = wait_for(lambda: (r := httpx.get(proxy.url + "/api/ready")).status_code == 503
                      and r, says="readiness fails")
    error = answer.json()["error"]
    assert error["type"] == "not_ready" and "have not been stored" in error["message"]
    assert httpx.get(proxy.url + "/api/health").status_code == 200  # alive all along
    private_postgres.start()
    wait_for(lambda: httpx.get(proxy.url + "/api/ready").status_code == 200,
             says="ready again once records are stored")
    assert len(proxy.stored()) == 1  # the record that waited is there
