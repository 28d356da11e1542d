"""The article's asymmetry, reproduced by the scheduler and cost model (no clock needed)."""

from __future__ import annotations

from phasewatch.sim.config import load_sim_settings, resolve
from phasewatch.sim.offline import Arrival, burst, simulate, summarize


def sweep(concurrency: int, prompt: int, **settings: object) -> tuple[float, float, float]:
    config = resolve(load_sim_settings(**settings))
    s = summarize(list(simulate(config, burst(concurrency, prompt, 128)).values()))
    return s.ttft_ms, s.itl_ms, s.throughput_tok_s


def test_longer_prompts_raise_ttft_linearly_and_leave_itl_flat() -> None:
    rows = {n: sweep(1, n) for n in (64, 256, 1024, 4096)}
    ttft = {n: r[0] for n, r in rows.items()}
    itl = [r[1] for r in rows.values()]
    assert ttft[64] < ttft[256] < ttft[1024] < ttft[4096]
    slope_low = (ttft[1024] - ttft[256]) / 768
    slope_high = (ttft[4096] - ttft[1024]) / 3072
    assert 0.8 < slope_high / slope_low < 1.4  # roughly linear
    assert max(itl) / min(itl) < 1.05  # flat


def test_concurrency_raises_itl_far_less_than_proportionally_and_throughput_climbs() -> None:
    rows = {c: sweep(c, 256) for c in (1, 4, 16, 64)}
    assert rows[64][1] / rows[1][1] < 1.3  # 64x the users, under 1.3x the ITL
    assert rows[64][2] > 20 * rows[1][2]  # throughput climbs
    assert rows[64][0] > rows[1][0]  # TTFT rises too


def test_past_max_num_seqs_ttft_rises_from_queueing_while_itl_stays_flat() -> None:
    at_limit = sweep(16, 256, max_num_seqs=16)
    past = sweep(64, 256, max_num_seqs=16)
    assert past[0] > 5 * at_limit[0]
    assert abs(past[1] - at_limit[1]) / at_limit[1] < 0.05


def test_a_long_prompt_stalls_other_streams_unless_prefill_is_chunked() -> None:
    gaps = {}
    for chunked in (False, True):
        config = resolve(
            load_sim_settings(
                enable_chunked_prefill=chunked, max_model_len=8192, max_num_batched_tokens=512
            )
        )
        traces = simulate(config, [Arrival("short", 0.0, 64, 300), Arrival("long", 0.5, 8000, 4)])
        gaps[chunked] = max(traces["short"].itls) * 1e3
    assert gaps[False] > 600  # one ~750 ms stall mid-stream
    assert gaps[True] < 80  # chunks of 512 tokens: a bump per step, not a stall
