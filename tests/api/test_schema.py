"""The API's answers match what `/openapi.json` declares, field for field, on real traffic.

Every answer of `/api/requests`, `/api/runs`, `/api/stats` and `/api/diagnosis` below comes from
the proxy of tests/api/conftest.py (the simulator's answers relayed and stored, a bench run,
the diagnosis schedule) and is validated against the schema its path declares for its status,
with no field left undeclared (tests/api/openapi_check.py). The document itself must describe
every field, with its unit where the name has one.
"""

from __future__ import annotations

import copy
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.api.conftest import STUDY, Served
from tests.api.openapi_check import ApiSchema

ROUTES = ("/api/requests", "/api/runs", "/api/runs/{run_id}", "/api/stats", "/api/diagnosis",
          "/api/diagnosis/history")


@pytest.fixture(scope="module")
def api(served: Served) -> ApiSchema:
    response = served.get("/openapi.json")
    assert response.status_code == 200
    return ApiSchema(response.json())


def z(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def test_every_route_declares_its_answer_and_its_errors(api: ApiSchema) -> None:
    for path in ROUTES:
        operation = api.doc["paths"][path]["get"]
        answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
        refs = [answer] if "$ref" in answer else answer.get("anyOf", [])
        assert refs and all(r["$ref"].startswith("#/components/schemas/") for r in refs), (
            path, answer)
        for status in ("401", "403", "422", "503"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}, (path, status)
        # A generated client gets a method name, and learns how to send the admin token.
        assert re.fullmatch(r"(list|get)[A-Z][A-Za-z]+", operation["operationId"]), path
        assert operation["security"] == [{"adminToken": []}, {"adminBearer": []}], path
        assert all(p.get("description") for p in operation.get("parameters", [])), path
    assert api.doc["components"]["securitySchemes"]["adminToken"]["name"] == (
        "x-phasewatch-admin-token")


# A unit a name promises, and the words its description must use for it.
UNITS = {r"_s$": "second", r"_rps$": "requests/s", r"_tps$": "tokens/s",
         r"(^|_)tokens?(_|$)": "token"}


def test_every_field_is_described_with_its_unit(api: ApiSchema) -> None:
    """Each property of each declared answer says what it is; one whose name carries a unit
    (`_s`, `_rps`, `_tps`, tokens) names that unit."""
    missing, unitless = [], []
    for name, schema in api.doc["components"]["schemas"].items():
        for field, prop in schema.get("properties", {}).items():
            description = prop.get("description", "")
            if not description.strip():
                missing.append(f"{name}.{field}")
            for pattern, unit in UNITS.items():
                if re.search(pattern, field) and unit not in description.lower():
                    unitless.append(f"{name}.{field} ({unit})")
    assert not missing, f"fields without a description: {missing}"
    assert not unitless, f"fields whose description does not name their unit: {unitless}"


def test_pages_of_requests(served: Served, api: ApiSchema) -> None:
    seen: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 7, **({"cursor": cursor} if cursor else {})}
        page = api.check(served.get("/api/requests", **params), "/api/requests")
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == served.records and len({r["id"] for r in seen}) == len(seen)
    # The nullable and enum fields were seen both ways: non-streamed (no TTFT), refused, run.
    assert {r["outcome"] for r in seen} == {"ok", "http_error"}
    assert any(r["ttft_s"] is None for r in seen) and any(r["ttft_s"] for r in seen)
    assert {r["endpoint"] for r in seen} == {"completions", "chat.completions"}
    assert any(r["run_id"] == served.bench_run for r in seen)
    refused = api.check(served.get("/api/requests", outcome="http_error", model="no-such-model"),
                        "/api/requests")
    assert len(refused["items"]) == 4 and all(r["http_status"] == 404 for r in refused["items"])


def test_runs_and_their_points(served: Served, api: ApiSchema) -> None:
    listed = api.check(served.get("/api/runs"), "/api/runs")
    assert [r["id"] for r in listed["items"]] == [STUDY, served.bench_run]
    first = api.check(served.get("/api/runs", limit=1), "/api/runs")
    assert first["next_cursor"] is not None
    rest = api.check(served.get("/api/runs", limit=1, cursor=first["next_cursor"]), "/api/runs")
    assert [r["id"] for r in rest["items"]] == [served.bench_run] and rest["next_cursor"] is None
    bench = api.check(served.get(f"/api/runs/{served.bench_run}"), "/api/runs/{run_id}")
    assert bench["status"] == "finished" and len(bench["points"]) == 1
    assert bench["points"][0]["requests"] == 6
    study = api.check(served.get(f"/api/runs/{STUDY}"), "/api/runs/{run_id}")
    assert study["status"] == "running" and study["summary"] is None and study["points"] == []


@pytest.mark.parametrize("by", ["model", "endpoint", "none"])
def test_stats_in_every_grouping(served: Served, api: ApiSchema, by: str) -> None:
    body = api.check(served.get("/api/stats", window="1h", by=by), "/api/stats")
    groups = {g["group"]: g for g in body["groups"]}
    expected = {"model": {served.model, "no-such-model"},
                "endpoint": {"completions", "chat.completions"}, "none": {None}}[by]
    assert set(groups) == expected
    assert sum(g["requests"] for g in body["groups"]) == served.records


def test_stats_of_a_run_and_of_an_empty_window(served: Served, api: ApiSchema) -> None:
    run = api.check(served.get("/api/stats", window="1h", run_id=served.bench_run),
                    "/api/stats")
    assert [g["requests"] for g in run["groups"]] == [6]
    empty = api.check(served.get("/api/stats", until=z(served.baseline[0]), window="1m"),
                      "/api/stats")
    assert empty["groups"] == [] and empty["sample"] == {"rows": 0, "of": 0}


def test_diagnosis_against_an_explicit_baseline(served: Served, api: ApiSchema) -> None:
    since, until = served.baseline
    seconds = (served.window_until - until).total_seconds()
    body = api.check(served.get("/api/diagnosis", model=served.model, window=f"{seconds:.3f}s",
                                until=z(served.window_until), baseline=f"{z(since)}/{z(until)}",
                                min_samples=5), "/api/diagnosis")
    assert body["baseline"]["kind"] == "range" and body["verdict"] != "insufficient_data"
    evidence = body["evidence"]
    # A full report: the comparisons, and the engine's own figures (the simulator's /metrics).
    assert evidence["ttft"] is not None and evidence["itl"] is not None
    assert evidence["engine"] is not None and body["engine_metrics"]["in_window"] is True


def test_diagnosis_with_the_default_and_a_run_baseline(served: Served, api: ApiSchema) -> None:
    present = api.check(served.get("/api/diagnosis", model=served.model, window="5m",
                                   min_samples=5), "/api/diagnosis")
    assert present["baseline"]["kind"] == "previous" and present["live"]["snapshots"] >= 1
    against_run = api.check(served.get("/api/diagnosis", model=served.model, window="1h",
                                       baseline=f"run:{served.bench_run}", min_samples=5),
                            "/api/diagnosis")
    assert against_run["baseline"]["run_id"] == served.bench_run


def test_diagnosis_of_every_model_and_of_too_little(served: Served, api: ApiSchema) -> None:
    every = api.check(served.get("/api/diagnosis", window="5m"), "/api/diagnosis")
    assert [item["model"] for item in every["items"]] == [served.model]
    past = served.baseline[0] - timedelta(hours=1)
    little = api.check(served.get("/api/diagnosis", model=served.model, window="1m",
                                  until=z(past)), "/api/diagnosis")
    assert little["verdict"] == "insufficient_data" and little["live"]["snapshots"] == 0
    assert set(little["evidence"]["checks"]) == {"enough_samples"}


def test_pages_of_verdict_changes(served: Served, api: ApiSchema) -> None:
    first = api.check(served.get("/api/diagnosis/history"), "/api/diagnosis/history")
    assert first["items"] and all(item["evidence"]["schedule"] for item in first["items"])
    one = api.check(served.get("/api/diagnosis/history", limit=1, model=served.model),
                    "/api/diagnosis/history")
    assert len(one["items"]) == 1


def test_errors_in_the_declared_format(served: Served, api: ApiSchema) -> None:
    refused = httpx.get(served.url + "/api/stats")  # no token
    assert refused.status_code == 401
    api.check(refused, "/api/stats")
    bad_window = api.check(served.get("/api/stats", window="soon"), "/api/stats")
    assert bad_window["error"]["code"] == 422
    bad_limit = api.check(served.get("/api/requests", limit=0), "/api/requests")
    assert bad_limit["error"]["param"] == "limit"
    bad_baseline = api.check(served.get("/api/diagnosis", model=served.model,
                                        baseline="run:never-ran"), "/api/diagnosis")
    assert bad_baseline["error"]["param"] == "baseline"
    missing = api.check(served.get("/api/runs/nope"), "/api/runs/{run_id}")
    assert missing["error"]["type"] == "not_found_error"


def test_an_undeclared_field_or_a_wrong_type_fails_the_check(
    served: Served, api: ApiSchema
) -> None:
    """The check can fail: a field the document does not declare, deep in the evidence or at
    the top, a null where none is allowed, a time without its zone."""
    body = served.get("/api/diagnosis", model=served.model, window="1h", min_samples=5).json()
    pointer = api.answer("/api/diagnosis", 200)
    assert api.problems(body, pointer) == []
    changes: list[tuple[list[str], str, Any]] = [
        ([], "latency_ms", 1.0),  # a field nobody declared
        (["evidence", "samples", "window"], "extra", 1),  # ... deep in the evidence
        ([], "confidence", None),  # a null where none is allowed
        ([], "verdict", "fine"),  # a verdict that is none of the eight
        (["window"], "since", "2026-01-01T10:00:00"),  # a time without its zone
    ]
    for where, key, value in changes:
        broken = copy.deepcopy(body)
        target = broken
        for step in where:
            target = target[step]
        target[key] = value
        assert api.problems(broken, pointer), (where, key, value)
    page = served.get("/api/requests", limit=1).json()
    page["items"][0]["ttft_ms"] = 1.0
    assert api.problems(page, api.answer("/api/requests", 200))


def test_times_are_utc_with_their_zone(served: Served, api: ApiSchema) -> None:
    record = served.get("/api/requests", limit=1).json()["items"][0]
    started = datetime.fromisoformat(record["started_at"])
    assert record["started_at"].endswith("Z") and started.utcoffset() == timedelta(0)
    assert abs(started - datetime.now(UTC)) < timedelta(minutes=10)


def test_the_probes_answer_as_declared(served: Served, api: ApiSchema) -> None:
    """Liveness and readiness are typed too, and open without the admin token."""
    health = api.check(httpx.get(served.url + "/api/health"), "/api/health")
    assert health["status"] == "ok" and health["role"] in ("leader", "follower")
    assert api.check(httpx.get(served.url + "/api/ready"), "/api/ready") == {"status": "ready"}
    assert "503" in api.doc["paths"]["/api/ready"]["get"]["responses"]
