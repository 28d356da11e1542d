"""The roofline cost model: prefill grows with prompt length, decode is flat until the ridge."""

from __future__ import annotations

import itertools

import pytest

from phasewatch.sim.config import load_sim_settings, resolve
from phasewatch.sim.costmodel import CostModel, Work


@pytest.fixture
def t4_qwen() -> CostModel:
    return resolve(load_sim_settings()).cost_model


def test_prefill_time_is_close_to_linear_in_prompt_length(t4_qwen: CostModel) -> None:
    times = {n: t4_qwen.prefill_s(n) for n in (1024, 2048, 4096, 8192)}
    # Each doubling adds about as much as the one before: linear matmuls, plus a modest
    # quadratic attention term that makes the increments grow by less than a quarter.
    steps = [times[2048] - times[1024], times[4096] - times[2048], times[8192] - times[4096]]
    for smaller, larger in itertools.pairwise(steps):
        assert 1.9 < larger / smaller < 2.5
    assert t4_qwen.step_cost([Work(4096, 0)]).bound == "compute"


def test_decode_step_is_flat_in_batch_until_the_ridge_then_grows(t4_qwen: CostModel) -> None:
    ridge = t4_qwen.effective_ridge_point  # ~74 sequences at the T4 preset's MFU/MBU
    one = t4_qwen.decode_step_s(1, 256)
    below = t4_qwen.decode_step_s(int(ridge * 0.5), 256)
    above = t4_qwen.decode_step_s(int(ridge * 4), 256)
    assert t4_qwen.step_cost([Work(1, 256)] * 8).bound == "memory"
    assert below / one < 1.1  # half the ridge: still paying for the weight read only
    assert above / one > 2.0  # four times the ridge: compute-bound, grows with the batch
    assert t4_qwen.step_cost([Work(1, 256)] * int(ridge * 4)).bound == "compute"


def test_decode_is_nearly_independent_of_context(t4_qwen: CostModel) -> None:
    assert t4_qwen.decode_step_s(1, 4096) / t4_qwen.decode_step_s(1, 64) < 1.05


def test_default_preset_lands_on_the_articles_table() -> None:
    config = resolve(load_sim_settings())
    cost = config.cost_model
    # Article (T4, Qwen2.5-0.5B, indicative): TTFT 41/58/119/372 ms, ITL ~9.8 ms.
    for prompt, article_ms in ((64, 41), (256, 58), (1024, 119), (4096, 372)):
        ttft_ms = (cost.prefill_s(prompt) + config.request_overhead_s) * 1e3
        assert ttft_ms == pytest.approx(article_ms, rel=0.12)
    assert cost.decode_step_s(1, 320) * 1e3 == pytest.approx(9.8, rel=0.05)


def test_weights_are_read_once_per_step_not_per_sequence(t4_qwen: CostModel) -> None:
    one = t4_qwen.step_cost([Work(1, 100)])
    many = t4_qwen.step_cost([Work(1, 100)] * 32)
    kv = t4_qwen.shape.kv_bytes_per_token * 101
    assert many.bytes == pytest.approx(one.bytes + 31 * kv)
