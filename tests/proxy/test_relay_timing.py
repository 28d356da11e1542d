"""The proxy's TTFT and ITL against an upstream that writes chunks at scripted times.

The scripted upstream runs in its own process and logs the CLOCK_MONOTONIC time at which it
wrote each chunk; the proxy's figures must match those times, and what the client itself saw,
within a few milliseconds.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import Proxy

# A gap between two reads of one stream is measured at both ends of one connection: tight.
GAP_TOLERANCE_S = 0.003
# TTFT also holds the request's own way in (client -> proxy -> upstream): about 1.5 ms here,
# but a busy neighbour on this shared 2-core machine can delay one hop by 10 ms or more. The
# overhead benchmark measures this leg properly; here it only bounds it. Under `make
# test-sanitize` (PHASEWATCH_TEST_NATIVE_DIR set) every hop runs through AddressSanitizer,
# a few times slower: that run is for memory errors, and its bound is four times as wide.
SANITIZED = bool(os.environ.get("PHASEWATCH_TEST_NATIVE_DIR"))
LEG_TOLERANCE_S = 0.025 * (4 if SANITIZED else 1)


def assert_ttft(ttft: float | None, log: dict[str, Any], write: int) -> None:
    """The proxy cannot see the token before the upstream wrote it, nor long after."""
    written = (log["sent_ns"][write] - log["arrived_ns"]) / 1e9
    assert ttft is not None
    assert written - 0.001 <= ttft <= written + LEG_TOLERANCE_S, (ttft, written)


def stream(proxy: Proxy, path: str, script: dict[str, Any], body: dict[str, Any] | None = None,
           ) -> tuple[str, float, list[tuple[float, bytes]]]:
    """Send one streamed request; return its id, the client's send time and each read it got."""
    request_id = uuid.uuid4().hex
    payload = {"model": "scripted", "stream": True, "max_tokens": 8, **(body or {})}
    payload["messages" if "chat" in path else "prompt"] = (
        [{"role": "user", "content": "hi"}] if "chat" in path else "hi"
    )
    reads: list[tuple[float, bytes]] = []
    with httpx.Client(timeout=30) as client:
        sent = time.monotonic()
        with client.stream("POST", proxy.url + path, json=payload,
                           headers={"x-script": orjson.dumps(script).decode(),
                                    "x-request-id": request_id}) as response:
            assert response.status_code == 200
            for data in response.iter_raw():
                reads.append((time.monotonic(), data))
    return request_id, sent, reads


def upstream_log(url: str, request_id: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/_log/{request_id}").json())


def proxy_upstream(proxy: Proxy) -> str:
    return str(proxy.server.app.state.proxy.upstream)


def undisturbed(sent: float, reads: list[tuple[float, bytes]], log: dict[str, Any],
                first: int, texts: list[str]) -> bool:
    """The machine let this exchange through on time, as the client saw it: the request
    reached the upstream within the leg tolerance (less a gap's) of the client's send, and
    each token reached the client within the gap tolerance of the upstream's write. The
    proxy stamps each read between those two moments, so then its TTFT and gaps are within
    the tolerances whatever else runs; a proxy that is late on its own still fails."""
    if log["arrived_ns"] / 1e9 - sent > LEG_TOLERANCE_S - GAP_TOLERANCE_S:
        return False
    for text, written_ns in zip(texts, log["sent_ns"][first:], strict=False):
        marker = orjson.dumps(text)
        seen = next((at for at, data in reads if marker in data), None)
        if seen is None or seen - written_ns / 1e9 > GAP_TOLERANCE_S:
            return False
    return True


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_ttft_and_itl_match_the_scripted_times(proxy: Proxy, scripted_url: str, path: str) -> None:
    script = {
        "role_at": 0.02,  # chat: a role-only chunk long before the first token
        "tokens": [[0.15, "Hello", 1], [0.17, " there", 1], [0.22, " my", 1],
                   [0.23, " friend", 1], [0.33, "!", 1]],
    }
    first = 1 if "chat" in path else 0  # the role-only chunk is not the first token
    # On this shared 2-core machine a neighbour can hold any process for tens of ms: an
    # exchange the client saw delayed is run again (at most 5 times), since no tolerance
    # could tell that delay from the proxy's own.
    ttfts: list[float | None] = []  # of every attempt
    for _ in range(5):
        request_id, sent, reads = stream(proxy, path, script)
        record = proxy.next_record()
        ttfts.append(record.ttft_s)
        log = upstream_log(scripted_url, request_id)
        if undisturbed(sent, reads, log, first, [t[1] for t in script["tokens"]]):
            break
    else:
        pytest.fail("every attempt reached the client late: too loaded to check to 3 ms")
    token_writes = [ns / 1e9 for ns in log["sent_ns"][first:first + 5]]

    assert record.outcome == "ok" and record.stream and record.model == "scripted"
    assert (record.prompt_tokens, record.output_tokens, record.tokens_exact) == (7, 5, True)
    assert_ttft(record.ttft_s, log, first)
    gaps = sorted(b - a for a, b in itertools.pairwise(token_writes))  # 20, 50, 10, 100 ms
    assert record.itl_count == 4
    assert record.itl_max_s == pytest.approx(gaps[-1], abs=GAP_TOLERANCE_S)
    assert record.itl_p50_s == pytest.approx(gaps[1], abs=GAP_TOLERANCE_S)
    assert record.itl_mean_s == pytest.approx(sum(gaps) / 4, abs=GAP_TOLERANCE_S)
    assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 4)
    # The same figures reached Prometheus, one ITL observation per token gap (every attempt).
    labels = {"model": "scripted", "endpoint": record.endpoint}
    assert proxy.sample("phasewatch_inter_token_latency_seconds_count", labels) == 4 * len(ttfts)
    assert proxy.sample("phasewatch_time_to_first_token_seconds_sum", labels) == pytest.approx(
        sum(t for t in ttfts if t is not None), abs=1e-9)


def test_proxy_figures_agree_with_what_the_client_saw(proxy: Proxy) -> None:
    script = {"tokens": [[0.1 + 0.03 * i, f" t{i}", 1] for i in range(10)]}
    _, sent, reads = stream(proxy, "/v1/completions", script)
    record = proxy.next_record()
    output_reads = [t for t, data in reads if b'"text":" t' in data]
    assert len(output_reads) == 10
    client_ttft = output_reads[0] - sent
    client_gaps = [b - a for a, b in itertools.pairwise(output_reads)]
    # The client started its clock before the proxy and saw the token after it.
    assert record.ttft_s is not None
    assert record.ttft_s - 0.001 <= client_ttft <= record.ttft_s + LEG_TOLERANCE_S
    assert record.itl_p50_s == pytest.approx(sorted(client_gaps)[4], abs=GAP_TOLERANCE_S)
    assert record.e2e_s is not None and record.e2e_s <= reads[-1][0] - sent + 0.001


def test_a_chunk_carrying_several_tokens_spreads_its_gap(proxy: Proxy) -> None:
    # 1 token at 100 ms, then 4 tokens together at 180 ms: 4 gaps of 20 ms each.
    script = {"tokens": [[0.1, "a", 1], [0.18, "bcde", 4], [0.2, "f", 1]]}
    stream(proxy, "/v1/completions", script)
    record = proxy.next_record()
    assert record.output_tokens == 6 and record.itl_count == 5 and record.tokens_exact
    assert record.itl_p50_s == pytest.approx(0.02, abs=GAP_TOLERANCE_S)
    assert record.itl_max_s == pytest.approx(0.02, abs=GAP_TOLERANCE_S)


def test_without_running_usage_tokens_are_estimated_and_marked(make_proxy: Any,
                                                                scripted_url: str) -> None:
    proxy = make_proxy(scripted_url, upstream_continuous_usage=False)
    script = {"tokens": [[0.1, "a", 1], [0.18, "bbbb", 4], [0.2, "c", 1]]}
    stream(proxy, "/v1/completions", script)
    record = proxy.next_record()
    assert record.output_tokens == 6 and not record.tokens_exact
    assert record.itl_count == 5  # the final usage count, spread by characters
    assert record.itl_max_s == pytest.approx(0.02, abs=GAP_TOLERANCE_S)


def test_events_split_across_reads_are_timed_when_they_complete(proxy: Proxy) -> None:
    script = {"split": True, "tokens": [[0.1, "a", 1], [0.15, "b", 1], [0.2, "c", 1]]}
    # Each event's second half is written 5 ms after its first (the upstream logs the time of
    # the second): only then is the token there to see. The gaps are those between the logged
    # writes (the upstream's own sleeps may run late on a busy machine), and an exchange the
    # client saw delayed is run again, as in test_ttft_and_itl_match_the_scripted_times.
    for _ in range(5):
        request_id, sent, reads = stream(proxy, "/v1/completions", script)
        record = proxy.next_record()
        log = upstream_log(proxy_upstream(proxy), request_id)
        if undisturbed(sent, reads, log, 0, ["a", "b", "c"]):
            break
    else:
        pytest.fail("every attempt reached the client late: too loaded to check to 3 ms")
    assert_ttft(record.ttft_s, log, 0)
    written = [ns / 1e9 for ns in log["sent_ns"][:3]]
    assert record.itl_count == 2
    assert record.itl_mean_s == pytest.approx((written[2] - written[0]) / 2, abs=GAP_TOLERANCE_S)


def test_non_streamed_request_records_e2e_and_tokens(proxy: Proxy) -> None:
    script = {"tokens": [[0.05, "a", 1], [0.12, "b", 2]]}
    response = httpx.post(proxy.url + "/v1/completions",
                          json={"model": "scripted", "prompt": "x", "max_tokens": 3},
                          headers={"x-script": orjson.dumps(script).decode(),
                                   "x-request-id": "non-streamed"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    record = proxy.next_record()
    assert not record.stream and record.ttft_s is None and record.itl_count == 0
    assert record.output_tokens == 3 and record.prompt_tokens == 7
    log = upstream_log(proxy_upstream(proxy), "non-streamed")
    written = (log["sent_ns"][0] - log["arrived_ns"]) / 1e9
    assert written - 0.001 <= record.e2e_s <= written + LEG_TOLERANCE_S
