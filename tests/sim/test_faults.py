"""Each x-sim-fault kind, observed from a real HTTP client."""

from __future__ import annotations

import itertools
import time

import httpx
import orjson
import pytest

from phasewatch.sim import RunningSim, load_sim_settings, running_sim

BODY = {"prompt": "word " * 16, "max_tokens": 10, "stream": True}


def read_events(response: httpx.Response) -> list[tuple[float, bytes]]:
    """(arrival time, payload) per SSE event, until the stream ends or breaks."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append((time.perf_counter(), line[6:].encode()))
    return events


def token_count(events: list[tuple[float, bytes]]) -> int:
    return sum(
        len(orjson.loads(e)["choices"][0]["text"].split())
        for _, e in events
        if e.startswith(b"{") and b'"choices":[{' in e
    )


def test_stall_pauses_the_stream_then_it_continues(sim: RunningSim) -> None:
    headers = {"x-sim-fault": "stall:after=5,seconds=2"}  # model seconds; x0.1 here
    with httpx.stream("POST", sim.url + "/v1/completions", json=BODY, headers=headers) as r:
        events = read_events(r)
    assert events[-1][1] == b"[DONE]" and token_count(events) == 10
    # Tokens per event (a lagging reader can get several in one): find the one with token 6.
    sent = token_count(events[:1])
    for (before, _), (at, payload) in itertools.pairwise(events):
        if sent >= 5:
            assert at - before >= 0.2 * 0.95  # 2 model seconds at time-scale 0.1
            break
        assert at - before < 0.1
        sent += token_count([(at, payload)])
    else:
        raise AssertionError("the stream never passed 5 tokens")


def test_disconnect_closes_the_connection_mid_body(sim: RunningSim) -> None:
    events: list[tuple[float, bytes]] = []
    headers = {"x-sim-fault": "disconnect:after=5"}
    with pytest.raises(httpx.RemoteProtocolError):  # incomplete chunked read
        with httpx.stream("POST", sim.url + "/v1/completions", json=BODY, headers=headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append((time.perf_counter(), line[6:].encode()))
    assert token_count(events) == 5 and events[-1][1] != b"[DONE]"


def test_error_is_sent_in_band_then_done(sim: RunningSim) -> None:
    headers = {"x-sim-fault": "error:after=3"}
    with httpx.stream("POST", sim.url + "/v1/completions", json=BODY, headers=headers) as r:
        assert r.status_code == 200
        events = read_events(r)
    assert token_count(events) == 3
    error = orjson.loads(events[-2][1])["error"]
    assert list(error) == ["message", "type", "param", "code"] and error["code"] == 500
    assert events[-1][1] == b"[DONE]"


@pytest.mark.parametrize("status", [500, 503])
def test_http_fault_answers_at_once_in_openai_error_format(sim: RunningSim, status: int) -> None:
    response = httpx.post(
        sim.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"x-sim-fault": f"http:{status}"},
    )
    assert response.status_code == status
    assert response.json()["error"]["code"] == status


def test_a_malformed_fault_header_is_a_400(sim: RunningSim) -> None:
    response = httpx.post(sim.url + "/v1/completions", json=BODY, headers={"x-sim-fault": "boom"})
    assert response.status_code == 400 and "x-sim-fault" in response.json()["error"]["param"]


def test_non_streaming_faults(sim: RunningSim) -> None:
    body = {**BODY, "stream": False}
    error = httpx.post(
        sim.url + "/v1/completions", json=body, headers={"x-sim-fault": "error:after=2"}
    )
    assert error.status_code == 500 and error.json()["error"]["type"] == "InternalServerError"
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(
            sim.url + "/v1/completions", json=body, headers={"x-sim-fault": "disconnect:after=2"}
        )


def test_client_going_away_aborts_the_request(sim: RunningSim) -> None:
    body = {"prompt": "word", "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", sim.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                request_id = orjson.loads(line[6:])["id"]
                break
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        timeline = httpx.get(f"{sim.url}/sim/requests/{request_id}").json()
        if timeline["aborted"]:
            break
        time.sleep(0.02)
    assert timeline["aborted"] and timeline["completion_tokens"] < 5000
    assert httpx.get(sim.url + "/sim/state").json()["num_running"] == 0


def test_a_server_wide_fault_applies_to_every_request() -> None:
    settings = load_sim_settings(port=0, time_scale=0.1, fault="http:503", max_model_len=4096)
    with running_sim(settings) as server:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503
        # A request's own header wins over the server's fault.
        ok = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 2},
            headers={"x-sim-fault": "stall:after=0,seconds=0"},
        )
        assert ok.status_code == 200
