"""phasewatch's live view of a real vLLM's queue: its streams waiting for a first token and
decoding, against vLLM's own `num_requests_waiting` and `num_requests_running`.

Six long prompts sent at once make vLLM queue most of them while it prefills one at a time
(each is 3,500 tokens; its default token budget per step holds one). vLLM counts a request in
prefill as running; phasewatch counts it as waiting (no first token yet). And phasewatch sees
a request as soon as it sends it, vLLM only once its HTTP front end has handed it to the
scheduler. So, judged on medians over the run (two reads a few ms apart each time):
- vLLM's running batch is phasewatch's decoding streams plus at most the one in prefill;
- vLLM's requests are among phasewatch's: its waiting + running <= phasewatch's waiting +
  decoding, and its waiting <= phasewatch's waiting.
The proxy's counts are read from its registry on its own loop as a render of its /metrics
reads them, vLLM's from its /metrics, in turn, every few ms until every stream has ended.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from typing import Any

from phasewatch.proxy.live import LiveStreams
from tests.conftest import Proxy
from tests.vllm.engine_metrics import Snapshot
from tests.vllm.server import VLLMServer
from tests.vllm.streams import stream, token_prompt

STREAMS = 6


def proxy_counts(proxy: Proxy) -> tuple[int, int]:
    registry: LiveStreams = proxy.server.app.api.state.proxy.live

    async def read() -> tuple[int, int]:
        # As a render of /metrics reads them (`before_render`): the streams the native leg
        # holds replayed first, so a first token it relayed is counted.
        await registry.refresh(full=True)
        counts = registry.counts(time.perf_counter_ns())
        return (sum(c.waiting for c in counts.values()),
                sum(c.decoding for c in counts.values()))

    assert proxy.server.loop is not None
    return asyncio.run_coroutine_threadsafe(read(), proxy.server.loop).result(5)


def test_live_gauges_follow_vllms_queue(vllm_server: VLLMServer, vllm_proxy: Proxy) -> None:
    model = vllm_server.model
    bodies: list[dict[str, Any]] = [
        {"model": model, "prompt": token_prompt(3500, 100 + i), "max_tokens": 32,
         "ignore_eos": True, "temperature": 0} for i in range(STREAMS)]
    results: list[Any] = []
    threads = [threading.Thread(
        target=lambda b=body: results.append(stream(vllm_proxy.url, "/v1/completions", b)))
        for body in bodies]
    for thread in threads:
        thread.start()
    samples: list[tuple[int, int, float, float]] = []
    while any(thread.is_alive() for thread in threads):
        waiting, decoding = proxy_counts(vllm_proxy)
        engine = Snapshot(vllm_server.metrics_text(), model)
        samples.append((waiting, decoding, engine["vllm:num_requests_waiting"],
                        engine["vllm:num_requests_running"]))
    for thread in threads:
        thread.join()
    assert len(results) == STREAMS and all(r.status == 200 for r in results)
    busy = [s for s in samples if s[0] + s[1] > 0]
    print("proxy waiting, decoding | vLLM waiting, running:",  # for `pytest -rP`
          ", ".join(f"{w} {d} | {ew:.0f} {er:.0f}" for w, d, ew, er in busy))
    assert len(busy) >= 5, samples
    assert any(s[2] > 0 and s[0] > 0 for s in busy), f"vLLM never queued: {samples}"
    assert any(s[1] > 0 for s in busy), samples  # the decoding state was seen as well
    # A stream decoding at the proxy is running in vLLM; vLLM's running batch also holds the
    # one request it is prefilling (one 3,500-token prompt fills a step): at most one more.
    batch_gap = statistics.median(er - d for _, d, _, er in busy)
    assert 0 <= batch_gap <= 1, samples
    # vLLM's requests are among the proxy's: the proxy also counts those still in vLLM's HTTP
    # front end, not yet in its scheduler (seen here: up to four, for a second, under load).
    assert statistics.median((ew + er) - (w + d) for w, d, ew, er in busy) <= 0, samples
    assert statistics.median(ew - w for w, _, ew, _ in busy) <= 0, samples
    assert proxy_counts(vllm_proxy) == (0, 0)
