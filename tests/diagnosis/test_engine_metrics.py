"""Reading an engine's /metrics: names of several vLLM versions, several engines and models,
text the Prometheus parser rejects; and a window's figures from a series of scrapes."""

from __future__ import annotations

import json

import httpx
import pytest

from phasewatch.engine import parse_engine_metrics
from phasewatch.engine.codec import snapshot_from_json, snapshot_to_json
from phasewatch.engine.parser import EngineSnapshot, EngineState, Histogram
from phasewatch.engine.window import histogram_increase, histogram_quantile, increase, summarize
from phasewatch.sim.config import load_sim_settings
from phasewatch.sim.server import running_sim

# vLLM v1 (0.10 and later): kv_cache_usage_perc, an `engine` label, counters with _total.
V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 2.0
vllm:num_requests_waiting{engine="1",model_name="qwen"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="qwen"} 0.91
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="qwen"} 4.0
vllm:num_preemptions_created{engine="0",model_name="qwen"} 1.7e9
vllm:num_preemptions_total{engine="1",model_name="qwen"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="qwen"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="qwen"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="qwen"} 8.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="qwen"} 8.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="qwen"} 2.4
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="qwen"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.5",model_name="qwen"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="qwen"} 2.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="qwen"} 2.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="qwen"} 0.3
# TYPE vllm:some_future_metric gauge
vllm:some_future_metric{model_name="qwen"} 12.0
"""

# vLLM v0 (before the rename): gpu_cache_usage_perc, swapped requests, no engine label.
V0 = """\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.97
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="llama"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 9.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="llama"} 17.0
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{model_name="llama"} 0.1
"""


def test_v1_names_summed_across_engines() -> None:
    snapshot = parse_engine_metrics(V1)
    state = snapshot.models["qwen"]
    assert (state.running, state.waiting, state.preemptions) == (8.0, 2.0, 5.0)
    assert state.kv_usage == 0.91  # the fullest engine
    assert state.ttft is not None
    assert state.ttft.buckets == ((0.1, 3.0), (0.5, 8.0), (float("inf"), 10.0))
    assert (state.ttft.count, state.ttft.sum) == (10.0, pytest.approx(2.7))
    assert snapshot.names["kv_usage"] == "vllm:kv_cache_usage_perc"
    assert snapshot.names["preemptions"] == "vllm:num_preemptions_total"


def test_v0_names() -> None:
    snapshot = parse_engine_metrics(V0)
    state = snapshot.models["llama"]
    assert (state.kv_usage, state.swapped, state.waiting, state.preemptions) == (
        0.97, 2.0, 9.0, 17.0)
    assert state.running is None and state.ttft is None
    assert snapshot.names["kv_usage"] == "vllm:gpu_cache_usage_perc"


def test_the_new_name_wins_when_both_are_exported() -> None:
    both = ('vllm:gpu_cache_usage_perc{model_name="m"} 0.2\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.7\n')
    assert parse_engine_metrics(both).models["m"].kv_usage == 0.7


def test_relabelled_prefix_percentages_and_several_models() -> None:
    text = ('vllm_kv_cache_usage_perc{model_name="a"} 85.0\n'
            'vllm_num_requests_waiting{model_name="b"} 3\n'
            'vllm:num_requests_waiting{model="c"} 1\n'
            'vllm:num_requests_running 4\n')
    snapshot = parse_engine_metrics(text)
    assert snapshot.models["a"].kv_usage == pytest.approx(0.85)
    assert snapshot.models["b"].waiting == 3.0
    assert snapshot.models["c"].waiting == 1.0
    assert snapshot.models[""].running == 4.0
    assert snapshot.for_model("b") is snapshot.models["b"]
    assert snapshot.for_model("nope") is None  # several models: no guessing


def test_text_the_parser_rejects_is_read_line_by_line() -> None:
    text = V0 + "this is { not prometheus\nvllm:num_requests_running{model_name=\"llama\"} 6\n"
    state = parse_engine_metrics(text).models["llama"]
    assert state.running == 6.0 and state.waiting == 9.0


@pytest.mark.parametrize("text", ["", "# just a comment\n", "garbage\n{}\n", "\x00\xff"])
def test_nothing_useful_is_an_empty_snapshot(text: str) -> None:
    snapshot = parse_engine_metrics(text)
    assert snapshot.models == {} and snapshot.for_model("m") is None


def test_the_simulators_metrics_parse() -> None:
    """The simulator serves vLLM's v1 names; a real vLLM is the other engineer's test."""
    with running_sim(load_sim_settings(port=0, served_model_name="sim-model")) as sim:
        text = httpx.get(sim.url + "/metrics").text
    snapshot = parse_engine_metrics(text)
    state = snapshot.for_model("whatever-the-client-calls-it")  # the only model
    assert state is snapshot.models["sim-model"]
    assert state.waiting == 0.0 and state.running == 0.0 and state.kv_usage == 0.0
    assert state.preemptions == 0.0 and state.ttft is not None and state.queue_time is not None


def test_a_snapshot_is_stored_as_strict_json_and_reads_back_equal() -> None:
    for text in (V1, V0):
        snapshot = parse_engine_metrics(text)
        data = snapshot_to_json(snapshot)
        stored = json.loads(json.dumps(data, allow_nan=False))  # Postgres refuses Infinity
        assert snapshot_from_json(stored) == snapshot
    assert snapshot_from_json({"models": {"m": {"waiting": 1, "later_signal": 2}}}).models[
        "m"].waiting == 1.0  # a signal a later version stored is skipped


def test_counter_increase_survives_a_restart() -> None:
    assert increase([5.0, 7.0, 7.0, 10.0]) == 5.0
    assert increase([5.0, 7.0, 2.0, 4.0]) == 2.0 + 2.0 + 2.0  # reset to 0 then 2, 4
    assert increase([3.0]) == 0.0


def test_histogram_quantile_like_prometheus() -> None:
    h = Histogram(((0.1, 2.0), (0.5, 6.0), (float("inf"), 8.0)), 8.0, 2.4)
    assert histogram_quantile(0.25, h) == pytest.approx(0.1)  # rank 2: the first bucket's top
    assert histogram_quantile(0.5, h) == pytest.approx(0.1 + 0.4 * (4 - 2) / 4)
    assert histogram_quantile(0.99, h) == 0.5  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, Histogram((), 0.0, 0.0)) is None
    before = Histogram(((0.1, 1.0), (0.5, 1.0), (float("inf"), 1.0)), 1.0, 0.05)
    delta = histogram_increase(before, h)
    assert delta.buckets[0] == (0.1, 1.0) and delta.count == 7.0
    assert histogram_increase(h, before) is before  # the engine restarted


def snap(waiting: float, kv: float, preemptions: float, ttft_count: float,
         ttft_sum: float) -> EngineSnapshot:
    ttft = Histogram(((0.1, ttft_count), (float("inf"), ttft_count)), ttft_count, ttft_sum)
    state = EngineState(waiting=waiting, running=2.0, kv_usage=kv, preemptions=preemptions,
                        ttft=ttft)
    return EngineSnapshot({"m": state}, {"waiting": "vllm:num_requests_waiting"})


def test_a_window_from_scrapes() -> None:
    history = [
        (90.0, snap(0, 0.1, 3, 10, 0.5)),  # before the window: the counters' reference
        (100.0, snap(2, 0.5, 3, 12, 0.6)),
        (105.0, snap(4, 0.95, 5, 20, 1.0)),
        (110.0, snap(0, 0.7, 6, 30, 1.5)),
        (120.0, snap(9, 1.0, 9, 40, 3.0)),  # after it
    ]
    window = summarize(history, 100.0, 110.0, "m")
    assert window is not None
    assert window.scrapes == 3
    assert window.waiting_mean == 2.0 and window.waiting_max == 4.0
    assert window.kv_usage_max == 0.95
    assert window.preemptions == 3.0  # 3 -> 6
    assert window.ttft_count == 20.0 and window.ttft_mean_s == pytest.approx(1.0 / 20)
    assert window.metric_names["waiting"] == "vllm:num_requests_waiting"
    assert summarize(history, 200.0, 300.0, "m") is None
    assert summarize([], 0.0, 1.0, "m") is None
