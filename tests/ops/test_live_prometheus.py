"""Every dashboard query against a real Prometheus scraping a real phasewatch and simulator.

The simulator and `phasewatch serve` (uvicorn) run as subprocesses on loopback; Prometheus
(/usr/bin/prometheus) runs on a free port with a temporary data directory, the scrape jobs of
deploy/prometheus.yml pointed at them, a 1 s scrape and evaluation interval, and the rendered
SLO rules. Streaming traffic goes through the proxy; then each panel query of the committed
dashboard JSON, with Grafana's variables substituted, must return data. The rules must load
and evaluate without error. The exemplars on the TTFT and ITL buckets are scraped (Prometheus
negotiates OpenMetrics) and name requests the proxy's API has stored.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml

from phasewatch.slo.files import load_spec
from phasewatch.slo.rules import render_groups
from tests.ops.conftest import DEPLOY, ROOT, SLO_FILE
from tests.support.readme import blocks
from tests.support.servers import free_port, subprocess_server, wait_http

DASHBOARD = ROOT / "grafana" / "dashboards" / "phasewatch.json"

# Exported by the diagnosis (app/phasewatch/diagnosis) on the proxy's /metrics; their panels are
# checked like every other.
DIAGNOSIS_METRICS = ("phasewatch_diagnosis_verdict", "phasewatch_diagnosis_confidence")
# Exported by the leader's capacity duty (app/phasewatch/plan/capacity.py), switched on here.
CAPACITY_METRICS = ("phasewatch_slo_headroom", "phasewatch_slo_max_rate_rps")


@dataclass(frozen=True, slots=True)
class PanelQuery:
    panel: str
    expr: str


def panel_queries() -> list[PanelQuery]:
    board = json.loads(DASHBOARD.read_text())
    found = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            found.append(PanelQuery(panel["title"], target["expr"]))
    return found


def substitute(expr: str, model_regex: str) -> str:
    """Grafana's variables as Grafana would fill them for this test's short time range."""
    return (expr.replace("$__rate_interval", "20s").replace("$__interval", "5s")
            .replace("$model", model_regex))


def is_diagnosis(query: PanelQuery) -> bool:
    return any(metric in query.expr for metric in DIAGNOSIS_METRICS)


@dataclass
class Stack:
    prometheus: str
    proxy: str
    model: str


def readme_flags() -> list[str]:
    """The flags README's "Prometheus and Grafana" starts Prometheus with, but its config file
    (exemplar storage: docker-compose.yml passes the same)."""
    (command,) = blocks("Prometheus and Grafana", "sh")
    program, *flags = shlex.split(command)
    assert program == "prometheus" and "--enable-feature=exemplar-storage" in flags
    return [flag for flag in flags if not flag.startswith("--config.file=")]


def _prometheus_config(proxy_port: int, sim_port: int, prometheus_port: int) -> dict[str, Any]:
    """deploy/prometheus.yml with its targets on loopback and 1 s intervals."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    # The README's copy-paste jobs are deploy/prometheus.yml's, as they are.
    (jobs,) = blocks("Prometheus and Grafana", "yaml")
    readme_jobs = yaml.safe_load(jobs)["scrape_configs"]
    assert readme_jobs == [job for job in config["scrape_configs"]
                           if job["job_name"] in {j["job_name"] for j in readme_jobs}]
    targets = {"phasewatch": f"127.0.0.1:{proxy_port}", "vllm": f"127.0.0.1:{sim_port}",
               "prometheus": f"127.0.0.1:{prometheus_port}"}
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == set(targets), f"deploy/prometheus.yml jobs changed: {jobs}"
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(DEPLOY / pattern) for pattern in config["rule_files"]]
    return config


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for _ in response.aiter_bytes():
            pass


async def drive_traffic(proxy: str, model: str, seconds: float, users: int) -> int:
    """`users` streams at a time, completions and chat, short and long prompts, for
    `seconds`."""
    done = 0
    deadline = time.monotonic() + seconds

    async def worker(index: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(timeout=30) as client:
            while time.monotonic() < deadline:
                words = "word " * (64 if (index + done) % 2 else 768)
                if index % 2:
                    await _stream(client, proxy + "/v1/completions", {
                        "model": model, "prompt": words, "max_tokens": 24, "stream": True})
                else:
                    await _stream(client, proxy + "/v1/chat/completions", {
                        "model": model, "messages": [{"role": "user", "content": words}],
                        "max_tokens": 24, "stream": True})
                done += 1

    await asyncio.gather(*(worker(i) for i in range(users)))
    return done


@pytest.fixture(scope="module")
def stack(prometheus_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("live")
    sim_port, proxy_port, prometheus_port = free_port(), free_port(), free_port()
    sim_args = ["-m", "phasewatch.sim", "--port", str(sim_port), "--log-level", "warning"]
    proxy_args = ["-m", "phasewatch.cli", "serve", "--upstream", f"http://127.0.0.1:{sim_port}",
                  "--port", str(proxy_port)]
    proxy_env = {"PHASEWATCH_LOG_LEVEL": "warning", "PHASEWATCH_ADMIN_OPEN": "true",
                 "PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{tmp / 'pw.db'}",
                 # Judge every second, so the verdict is exported within the test's traffic.
                 "PHASEWATCH_DIAGNOSIS_INTERVAL_S": "1",
                 # And calibrate the SLO headroom every second, on two concurrency levels.
                 "PHASEWATCH_CAPACITY_INTERVAL_S": "1"}
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(_prometheus_config(proxy_port, sim_port, prometheus_port)))
    prometheus_url = f"http://127.0.0.1:{prometheus_port}"
    with subprocess_server(sim_args, f"http://127.0.0.1:{sim_port}/health"), \
            subprocess_server(proxy_args, f"http://127.0.0.1:{proxy_port}/api/health",
                              env=proxy_env):
        log = (tmp / "prometheus.log").open("wb")
        prometheus = subprocess.Popen(
            [prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{prometheus_port}", "--log.level=warn",
             *readme_flags()],
            stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            wait_http(prometheus_url + "/-/ready", timeout=30, proc=prometheus)
            proxy = f"http://127.0.0.1:{proxy_port}"
            model = httpx.get(proxy + "/v1/models").json()["data"][0]["id"]
            requests = asyncio.run(drive_traffic(proxy, model, seconds=4.0, users=2))
            requests += asyncio.run(drive_traffic(proxy, model, seconds=4.0, users=6))
            assert requests >= 30, f"only {requests} requests went through"
            time.sleep(3.0)  # a few more scrapes and rule evaluations after the traffic
            yield Stack(prometheus_url, proxy, model)
        finally:
            prometheus.terminate()
            try:
                prometheus.wait(timeout=10)
            except subprocess.TimeoutExpired:
                prometheus.kill()
                prometheus.wait()
            log.close()


def instant(stack: Stack, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(stack.prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return list(body["data"]["result"])


def unanswered(stack: Stack, queries: list[PanelQuery], patience_s: float = 15.0) -> list[str]:
    """The queries that still return no data after `patience_s`, each with both `$model`
    fillings: Grafana's All (".*") and the one model selected (regex-escaped, as Grafana does)."""
    pending = {(q.panel, substitute(q.expr, fill))
               for q in queries for fill in (".*", re.escape(stack.model).replace("\\", "\\\\"))}
    deadline = time.monotonic() + patience_s
    while True:
        pending = {(panel, expr) for panel, expr in pending if not instant(stack, expr)}
        if not pending or time.monotonic() >= deadline:
            return sorted(f"{panel}: {expr}" for panel, expr in pending)
        time.sleep(1.0)


def test_the_stack_is_scraped(stack: Stack) -> None:
    targets = httpx.get(stack.prometheus + "/api/v1/targets").json()["data"]["activeTargets"]
    health = {t["labels"]["job"]: t["health"] for t in targets}
    assert health == {"phasewatch": "up", "vllm": "up", "prometheus": "up"}, targets


def test_every_rule_loads_and_evaluates(stack: Stack) -> None:
    groups = httpx.get(stack.prometheus + "/api/v1/rules").json()["data"]["groups"]
    loaded = {(g["name"], r["name"]) for g in groups for r in g["rules"]}
    rendered = {(g["name"], r.get("record") or r["alert"])
                for g in render_groups(load_spec(SLO_FILE)) for r in g["rules"]}
    assert loaded == rendered
    broken = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"]
              if r["health"] != "ok"]
    assert broken == []
    # And the SLIs came out of the traffic: every window's burn rate has a value for the model.
    burn = instant(stack, 'phasewatch:ttft_slo_burn:rate3d')
    assert [series["metric"]["model"] for series in burn] == [stack.model]


def test_panel_queries_return_data(stack: Stack) -> None:
    queries = panel_queries()
    assert len(queries) >= 40
    assert len([q for q in queries if is_diagnosis(q)]) == 2
    assert len([q for q in queries if any(m in q.expr for m in CAPACITY_METRICS)]) == 2
    missing = unanswered(stack, queries)
    print(f"{len(queries)} panel queries x 2 $model fillings: {2 * len(queries) - len(missing)} "
          "returned data")
    assert missing == []


def test_queries_that_return_nothing_are_caught(stack: Stack) -> None:
    """The check can fail: a misspelt metric stays unanswered."""
    wrong = [PanelQuery("x", 'sum(rate(phasewatch_time_to_first_token_second_count'
                             '{model=~"$model"}[$__rate_interval]))')]
    assert len(unanswered(stack, wrong, patience_s=0.0)) == 2



def test_exemplars_are_scraped_and_name_stored_requests(stack: Stack) -> None:
    now = time.time()
    found: dict[str, set[str]] = {}
    for histogram in ("phasewatch_time_to_first_token_seconds",
                      "phasewatch_inter_token_latency_seconds"):
        response = httpx.get(stack.prometheus + "/api/v1/query_exemplars", params={
            "query": f"{histogram}_bucket", "start": now - 600, "end": now + 60}, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", body
        found[histogram] = {exemplar["labels"]["request_id"]
                            for series in body["data"] for exemplar in series["exemplars"]}
    assert all(found.values()), f"no exemplars scraped: {found}"
    # Each names a request whose record the proxy stored.
    request_id = sorted(found["phasewatch_inter_token_latency_seconds"])[0]
    items = httpx.get(stack.proxy + "/api/requests",
                      params={"request_id": request_id}).json()["items"]
    assert [item["request_id"] for item in items] == [request_id]
