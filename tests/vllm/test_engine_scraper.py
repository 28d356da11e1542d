"""The diagnosis's engine scraper against a real vLLM's /metrics: every signal it reads is found
under this version's names, its figures equal vLLM's own, and a proxy in front of vLLM scrapes
them and puts the engine's TTFT next to its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from phasewatch.engine import parse_engine_metrics
from tests.conftest import Proxy
from tests.vllm.engine_metrics import Snapshot
from tests.vllm.server import VLLMServer
from tests.vllm.streams import token_prompt

COMPLETIONS = "/v1/completions"


def _complete(base_url: str, model: str, prompt_tokens: int, seed: int) -> None:
    body = {"model": model, "prompt": token_prompt(prompt_tokens, seed), "max_tokens": 8,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream(
        "POST", base_url + COMPLETIONS, json=body
    ) as response:
        assert response.status_code == 200
        for _ in response.iter_bytes():
            pass


def test_every_signal_is_read_from_this_vllms_metrics(vllm_server: VLLMServer) -> None:
    _complete(vllm_server.url, vllm_server.model, 32, 101)
    text = vllm_server.metrics_text()
    snapshot = parse_engine_metrics(text)
    state = snapshot.for_model(vllm_server.model)
    assert state is not None, f"no model found in vLLM's metrics: {list(snapshot.models)}"
    # vLLM's own figures, read by the tests' independent helper, for comparison.
    own = Snapshot(text, vllm_server.model)
    for signal in ("waiting", "running", "kv_usage", "preemptions", "prompt_tokens",
                   "generation_tokens", "ttft", "queue_time"):
        assert signal in snapshot.names, f"{signal}: none of its names found in vLLM's /metrics"
        assert snapshot.names[signal] + ("_count" if signal in ("ttft", "queue_time") else "") \
            in own.values or snapshot.names[signal] in own.values
    assert state.waiting == own["vllm:num_requests_waiting"]
    assert state.running == own["vllm:num_requests_running"]
    assert state.kv_usage is not None and 0.0 <= state.kv_usage <= 1.0
    assert state.preemptions == own[snapshot.names["preemptions"]]
    assert state.generation_tokens == own[snapshot.names["generation_tokens"]] >= 8
    assert state.ttft is not None and state.ttft.count >= 1
    assert state.ttft.count == own["vllm:time_to_first_token_seconds_count"]
    assert abs(state.ttft.sum - own["vllm:time_to_first_token_seconds_sum"]) < 1e-9
    assert state.ttft.buckets[-1][0] == float("inf")
    assert state.ttft.buckets[-1][1] == state.ttft.count


def test_a_proxy_scrapes_vllm_and_shows_the_engines_ttft_beside_its_own(
    vllm_server: VLLMServer, make_proxy: Callable[..., Proxy]
) -> None:
    proxy = make_proxy(vllm_server.url, engine_scrape_interval_s=0.5, diagnosis_interval_s=0,
                       diagnosis_min_samples=5)
    time.sleep(1.0)  # the scraper's first snapshots come before the first request
    since = time.time()
    for seed in range(12):
        _complete(proxy.url, vllm_server.model, 48, 200 + seed)
    time.sleep(1.2)  # at least two scrapes after the last request
    assert proxy.sample("phasewatch_engine_scrape_up") == 1
    window = max(5, int(time.time() - since) + 2)
    response = httpx.get(proxy.url + "/api/diagnosis",
                         params={"model": vllm_server.model, "window": f"{window}s"}, timeout=30)
    assert response.status_code == 200, response.text
    evidence: dict[str, Any] = response.json()["evidence"]
    engine = evidence["engine"]
    assert engine is not None and engine["scrapes"] >= 2
    assert engine["metric_names"]["ttft"] == "vllm:time_to_first_token_seconds"
    assert engine["ttft_count"] >= 12
    side = evidence["ttft_proxy_vs_engine"]
    # The proxy's clock starts before vLLM's and stops after it: its mean is never smaller.
    assert side["proxy_mean_s"] >= side["engine_mean_s"] > 0
    assert side["gap_mean_s"] < 0.25, side
