"""The bench's arithmetic, on results built by hand: what each figure counts and leaves out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from phasewatch.bench.client import RequestResult
from phasewatch.bench.compare import MOVED, UNKNOWN, WITHIN, changes, verdict
from phasewatch.bench.errors import WorkloadError
from phasewatch.bench.load import poisson_offsets
from phasewatch.bench.long_prompt import size_long_prompt
from phasewatch.bench.prompts import PromptBuilder
from phasewatch.bench.result import point_row, spread
from phasewatch.bench.stats import Slo, concurrency_max, figures, slo_verdict
from phasewatch.bench.target import cache_config, scheduler_config

MS = 1_000_000  # ns


def result(sent_ms: float, first_ms: float, gaps_ms: list[float], tokens: int | None = None,
           ok: bool = True, prompt: int = 10) -> RequestResult:
    """A request sent at `sent_ms`, first token at +`first_ms`, then tokens `gaps_ms` apart."""
    stamps = [int((sent_ms + first_ms) * MS)]
    for gap in gaps_ms:
        stamps.append(stamps[-1] + int(gap * MS))
    return RequestResult(
        ok=ok, error=None if ok else "http 503: busy", sent_ns=int(sent_ms * MS),
        ended_ns=stamps[-1] + MS, ttft_s=first_ms / 1e3, gaps_s=[g / 1e3 for g in gaps_ms],
        output_ns=stamps if ok else [], output_events=len(stamps),
        prompt_tokens=prompt, output_tokens=len(stamps) if tokens is None else tokens,
    )


def test_errors_are_counted_and_kept_out_of_every_latency_and_token_count() -> None:
    good = [result(0, 40, [10, 10, 10]), result(0, 60, [20, 20, 20])]
    bad = result(0, 5000, [900, 900], ok=False)
    fig = figures([*good, bad], span_s=0.2)
    assert (fig.requests, fig.errors, fig.error_kinds) == (3, 1, {"http 503": 1})
    assert fig.ttft_s["p99"] == pytest.approx(0.060)  # the failed request's 5 s is not there
    assert fig.itl_max_s == pytest.approx(0.020)
    assert fig.output_tokens == 8 and fig.prompt_tokens == 20
    # Throughput is tokens over the measured span, not a formula of TTFT and ITL.
    assert fig.output_tps == pytest.approx(8 / 0.2)
    assert fig.total_tps == pytest.approx(28 / 0.2)


def test_percentiles_are_nearest_rank_over_pooled_gaps() -> None:
    gaps = [[10.0] * 50, [10.0] * 45 + [50.0] * 5]
    fig = figures([result(0, 40, g) for g in gaps], span_s=1.0)
    assert fig.itl_s["p50"] == pytest.approx(0.010)
    assert fig.itl_s["p90"] == pytest.approx(0.010)  # 95 of 100 gaps are 10 ms
    assert fig.itl_s["p95"] == pytest.approx(0.010)
    assert fig.itl_s["p99"] == pytest.approx(0.050)


def test_achieved_concurrency_is_measured_not_asked_for() -> None:
    # Two requests overlap for half of each, a third runs alone afterwards.
    rs = [result(0, 10, [10] * 8), result(50, 10, [10] * 8), result(300, 10, [10] * 8)]
    assert concurrency_max(rs) == 2
    span = (rs[-1].ended_ns - rs[0].sent_ns) / 1e9
    fig = figures(rs, span)
    busy = sum(r.e2e_s for r in rs)
    assert fig.concurrency_mean == pytest.approx(busy / span)
    assert 0.5 < fig.concurrency_mean < 2


def test_model_time_divides_durations_and_multiplies_rates() -> None:
    rs = [result(0, 40, [10, 10])]
    wall, model = figures(rs, 0.1), figures(rs, 0.1, scale=2.0)
    assert model.ttft_s["p50"] == pytest.approx(wall.ttft_s["p50"] / 2)  # type: ignore[operator]
    assert model.itl_s["p50"] == pytest.approx(wall.itl_s["p50"] / 2)  # type: ignore[operator]
    assert model.output_tps == pytest.approx(wall.output_tps * 2)


def test_goodput_counts_requests_meeting_both_objectives() -> None:
    slo = Slo(ttft_s=0.1, itl_s=0.02, quantile="p50")
    rs = [result(0, 50, [10] * 4),  # meets both
          result(0, 150, [10] * 4),  # TTFT too slow
          result(0, 50, [30] * 4),  # too slow per token
          result(0, 50, [10] * 4, ok=False)]  # failed
    fig = figures(rs, span_s=1.0, slo=slo)
    assert fig.slo_requests_met == 1 and fig.goodput_rps == pytest.approx(1.0)
    assert fig.slo_attainment == pytest.approx(0.25)  # the failed request is not good
    assert (fig.slo_ttft_over, fig.slo_itl_over) == (1, 1)
    met, reasons = slo_verdict(fig, slo)
    assert not met and reasons == [
        "1 of 4 requests good (25.0%, needs 50%): 1 over the TTFT objective 100 ms, 1 over "
        "the ITL objective 20 ms (TPOT), 1 failed", "1 of 4 requests failed"]
    # Looser objectives: 3 of 4 are good, at least the half p50 asks for.
    loose = Slo(0.2, 0.04, "p50", max_error_rate=0.5)
    fig = figures(rs, span_s=1.0, slo=loose)
    assert slo_verdict(fig, loose) == (True, []) and fig.goodput_rps == pytest.approx(3.0)


def test_the_verdict_counts_requests_good_on_both_objectives_at_once() -> None:
    # Half the requests are slow to start, the other half slow per token: p50 TTFT and p50
    # TPOT are each within the objectives, but no request meets both.
    slo = Slo(ttft_s=0.1, itl_s=0.02, quantile="p50")
    rs = [result(0, 50, [30] * 4), result(0, 150, [10] * 4)] * 2
    fig = figures(rs, span_s=1.0, slo=slo)
    assert fig.ttft_s["p50"] == pytest.approx(0.05) and fig.tpot_s["p50"] == pytest.approx(0.01)
    assert fig.slo_requests_met == 0 and fig.goodput_rps == 0
    assert slo_verdict(fig, slo)[0] is False


def test_a_point_keeps_each_repeat_and_the_spread_between_them() -> None:
    reps = [figures([result(0, ttft, [10, 10])], 0.1) for ttft in (40, 44, 41)]
    pooled = figures([result(0, ttft, [10, 10]) for ttft in (40, 44, 41)], 0.3)
    row = point_row(0, "prompt_tokens", 64, pooled, reps)
    assert [r["ttft_p50_s"] for r in row["extra"]["repeats"]] == pytest.approx([.040, .044, .041])
    assert row["extra"]["spread"]["ttft_p50_s"] == pytest.approx(0.004)
    assert row["ttft_p50_s"] == pytest.approx(0.041)
    assert spread([{"a": 1.0}]) == {}  # one repeat: no spread, not a spread of zero


def test_compare_calls_a_change_moved_only_beyond_twice_the_noise() -> None:
    assert verdict(100.0, 130.0, 10.0, 5.0) == MOVED
    assert verdict(100.0, 115.0, 10.0, 5.0) == WITHIN
    assert verdict(100.0, 300.0, None, 5.0) == UNKNOWN
    assert verdict(1.0, 1.0 + 1e-12, 0.0, 0.0) == WITHIN  # float dust is not a move

    def point(x: float, ttft: float, noise: float) -> dict[str, object]:
        return {"step": 0, "x_name": "concurrency", "x_value": x, "ttft_p50_s": ttft,
                "extra": {"spread": {"ttft_p50_s": noise}}}

    rows = changes([point(4, 0.1, 0.01), point(8, 0.2, 0.01)], [point(4, 0.2, 0.01)])
    assert [(r["x"], r["figure"], r["verdict"]) for r in rows] == [
        ("concurrency 4", "TTFT p50", MOVED)]
    assert rows[0]["ratio"] == pytest.approx(2.0)


def test_poisson_schedules_differ_only_by_their_rate() -> None:
    slow, fast = poisson_offsets(2.0, 200, seed=7), poisson_offsets(8.0, 200, seed=7)
    assert fast == pytest.approx([t / 4 for t in slow])
    assert poisson_offsets(2.0, 200, seed=8) != slow
    assert 200 / slow[-1] == pytest.approx(2.0, rel=0.25)


def test_vllm_cache_config_labels_are_read_from_metrics() -> None:
    text = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
            '# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",'
            'gpu_memory_utilization="0.9",num_gpu_blocks="27152"} 1.0\n')
    assert cache_config(text) == {"block_size": "16", "cache_dtype": "auto",
                                  "gpu_memory_utilization": "0.9", "num_gpu_blocks": "27152"}
    assert cache_config("phasewatch_requests_total 3.0\n") is None


def test_vllm_scheduler_budget_is_read_from_server_info() -> None:
    # GET /server_info?config_format=json (VLLM_SERVER_DEV_MODE=1): the VllmConfig, dumped.
    info = {"vllm_config": {"scheduler_config": {"max_num_batched_tokens": 8192,
                                                 "enable_chunked_prefill": True}},
            "vllm_env": {}}
    assert scheduler_config(info) == {"max_num_batched_tokens": 8192,
                                      "enable_chunked_prefill": True, "from": "/server_info"}
    older = {"vllm_config": {"scheduler_config": {"max_num_batched_tokens": 2048,
                                                  "chunked_prefill_enabled": False}}}
    assert scheduler_config(older)["enable_chunked_prefill"] is False  # type: ignore[index]
    assert scheduler_config({"vllm_config": "VllmConfig(...)"}) is None  # the text format
    assert scheduler_config(None) is None


class Counted(PromptBuilder):
    """A prompt builder whose tokenizer is a function: no server needed to test the search."""

    def __init__(self, count: Callable[[str], int]) -> None:
        super().__init__(None, "", "m")  # type: ignore[arg-type]
        self.method, self._count = "local", count

    async def count(self, text: str) -> int:
        return self._count(text)


def bpe_like(text: str) -> int:
    """"word" is three tokens, a space joins the next word, "a " is one, plus a BOS token."""
    return 1 + 3 * text.count("word") + text.count("a ")


@pytest.mark.parametrize("count", [bpe_like, lambda text: len(text.split())])
@pytest.mark.parametrize("tokens", [4, 16, 17, 18, 1000])
def test_prompts_hit_the_exact_count_whatever_a_word_costs(
    count: Callable[[str], int], tokens: int
) -> None:
    prompt = asyncio.run(Counted(count).prompt(tokens))
    assert count(prompt.text) == tokens and prompt.tokens == tokens and prompt.exact


def test_a_count_no_prompt_can_have_is_refused() -> None:
    with pytest.raises(WorkloadError, match="exactly 2 tokens"):
        asyncio.run(Counted(lambda text: 5 * len(text.split())).prompt(2))


def test_the_long_prompt_is_sized_past_the_budget_and_says_when_it_cannot_be() -> None:
    # vLLM's budget on a 70 GiB+ GPU: four chunks, capped by max_model_len.
    h100 = size_long_prompt(None, 8192, True, 32768, 4)
    assert (h100.tokens, h100.same_step) == (32764, None)
    assert size_long_prompt(None, 2048, True, 32768, 4).tokens == 8192  # a T4's budget
    # Unknown, or chunked prefill off (its budget is max_model_len): twice vLLM's largest.
    assert size_long_prompt(None, None, None, 131072, 4).tokens == 16384
    off = size_long_prompt(None, 32768, False, 32768, 4)
    assert off.tokens == 16384 and "chunked prefill is off" in off.how and off.same_step is None
    # The old default under an 8192-token budget: one step either way, and the report says so.
    old = size_long_prompt(8000, 8192, True, 131072, 4)
    assert old.tokens == 8000 and old.same_step is not None
    assert "fits in one step of max_num_batched_tokens 8192" in old.same_step
    assert "above 8191" in old.same_step
    short = size_long_prompt(None, 8192, True, 8192, 4)  # max_model_len leaves no room
    assert short.tokens == 8188 and short.same_step is not None
    assert "lower the server's --max-num-batched-tokens" in short.same_step
