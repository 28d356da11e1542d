"""`phasewatch plan` on what a real proxy stored: traffic from closed-loop clients through the
proxy to the simulator, then the command, as an operator runs it, on that database."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from phasewatch.sim import load_sim_settings, running_sim
from tests.conftest import Proxy
from tests.support.served import wait_for
from tests.support.servers import free_port, subprocess_server

PROMPT_WORDS = (40, 120, 300)


def users(base: str, model: str, count: int, each: int) -> int:
    """`count` users, each sending `each` streamed completions one after another."""
    def user(number: int) -> int:
        with httpx.Client(timeout=60) as client:
            for i in range(each):
                body = {"model": model, "prompt": "word " * PROMPT_WORDS[(number + i) % 3],
                        "max_tokens": 24, "stream": True, "ignore_eos": True}
                with client.stream("POST", base + "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    response.read()
        return each

    with ThreadPoolExecutor(count) as pool:
        return sum(pool.map(user, range(count)))


def plan(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "phasewatch.cli", "plan", "--database-url", database_url,
         "--requests", "400", *args], capture_output=True, text=True, timeout=300)


def test_plan_answers_from_what_the_proxy_stored(make_proxy: Callable[..., Proxy],
                                                 sqlite_url: str) -> None:
    settings = load_sim_settings(port=0, gpu="a100", model="llama-3.1-8b", max_num_seqs=16)
    with running_sim(settings) as sim:
        proxy = make_proxy(sim.url, diagnosis_interval_s=0, engine_metrics_enabled=False)
        model = httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"]
        before = plan(sqlite_url, "--concurrency", "4")
        sent = users(proxy.url, model, 2, 20) + users(proxy.url, model, 6, 10)
        wait_for(lambda: proxy.sample("phasewatch_records_written_total") >= sent,
                 says="every record stored")
        proxy.server.stop()
    # Nothing stored yet: refused, with the reason.
    assert before.returncode == 2 and "calibration needs at least 30" in before.stderr

    answered = plan(sqlite_url, "--concurrency", "12", "--max-num-seqs", "16", "--json")
    assert answered.returncode == 0, answered.stderr
    result = json.loads(answered.stdout)
    assert result["model"] == model and result["calibration"]["observed"]["requests"] == sent
    predicted = result["predicted"]
    assert 0 < predicted["ttft_p50_s"] <= predicted["ttft_p95_s"]
    assert 0 < predicted["itl_p50_s"] <= predicted["itl_p95_s"]
    assert 0.0 <= result["slo"]["ttft_share"] <= 1.0 and 0.0 <= result["slo"]["itl_share"] <= 1.0
    assert result["replicas_needed"] is None or result["replicas_needed"] >= 1
    assert result["limits"]["assumed"] == [] and result["cannot_see"]

    text = plan(sqlite_url, "--rate", "5", "--prompt-tokens", "4000")
    assert text.returncode == 0, text.stderr
    assert "phasewatch plan:" in text.stdout and "extrapolated: prompts of 4000-4000" in text.stdout
    assert "assumed: max_num_seqs 256" in text.stdout


def test_the_leader_exports_the_slo_headroom(make_proxy: Callable[..., Proxy]) -> None:
    """With `capacity_interval_s` set, the leading process calibrates on what it stored (in a
    worker process) and exports the highest rate within both SLOs and its ratio to the rate it
    serves."""
    settings = load_sim_settings(port=0, gpu="a100", model="llama-3.1-8b", max_num_seqs=16)
    with running_sim(settings) as sim:
        proxy = make_proxy(sim.url, diagnosis_interval_s=0, engine_metrics_enabled=False,
                           capacity_interval_s=1.0, capacity_max_num_seqs=16,
                           capacity_rate_window_s=300.0)
        model = httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"]
        sent = users(proxy.url, model, 2, 20) + users(proxy.url, model, 6, 10)
        wait_for(lambda: proxy.sample("phasewatch_records_written_total") >= sent,
                 says="every record stored")
        labels = {"model": model}
        rate = sent / 300.0  # the rate it serves: the requests of the rate's window

        def consistent() -> tuple[float, float] | None:
            """A round after the traffic: its headroom is its highest rate over that rate."""
            top = proxy.sample("phasewatch_slo_max_rate_rps", labels)
            headroom = proxy.sample("phasewatch_slo_headroom", labels)
            return (top, headroom) if top and abs(headroom * rate / top - 1) < 0.01 else None

        top, headroom = wait_for(consistent, timeout=120, says="a headroom after the traffic")
        proxy.server.stop()
    assert top > rate and headroom > 1.0


def _workers(pid: int) -> set[int]:
    """`pid`'s children that are multiprocessing workers (not its resource tracker)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.add(int(child))
            except FileNotFoundError:
                pass
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, PR_SET_PDEATHSIG")
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_calibration_worker_ends_with_its_process(stop: signal.Signals,
                                                      sqlite_url: str) -> None:
    """The headroom's worker process ends when the proxy ends, stopped or killed: none is left
    behind waiting for work."""
    settings = load_sim_settings(port=0, gpu="a100", model="llama-3.1-8b", max_num_seqs=16)
    with running_sim(settings) as sim:
        port = free_port()
        env = {"PHASEWATCH_DATABASE_URL": sqlite_url, "PHASEWATCH_LOG_LEVEL": "warning",
               "PHASEWATCH_CAPACITY_INTERVAL_S": "0.5", "PHASEWATCH_DIAGNOSIS_INTERVAL_S": "0"}
        url = f"http://127.0.0.1:{port}"
        with subprocess_server(["-m", "phasewatch.cli", "serve", "--upstream", sim.url,
                                "--port", str(port)], url + "/api/health", env=env) as proc:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            users(url, model, 2, 3)  # an active model: the duty's first round starts its worker
            workers = wait_for(lambda: _workers(proc.pid), timeout=60,
                               says="the calibration worker started")
            os.kill(proc.pid, stop)
            proc.wait(timeout=15)
            wait_for(lambda: not any(_alive(pid) for pid in workers), timeout=15,
                     says=f"the worker ended after {stop.name}")
