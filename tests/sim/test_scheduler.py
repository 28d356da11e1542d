"""The pure scheduler: continuous batching, token budget, chunked prefill, KV blocks."""

from __future__ import annotations

import pytest

from phasewatch.sim.config import load_sim_settings, resolve
from phasewatch.sim.costmodel import CostModel
from phasewatch.sim.scheduler import Scheduler, SchedulerConfig, Step


@pytest.fixture
def cost() -> CostModel:
    return resolve(load_sim_settings()).cost_model


def make(cost: CostModel, **overrides: int | bool) -> Scheduler:
    values: dict[str, int | bool] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "enable_chunked_prefill": True,
        "num_kv_blocks": 1000,
        "block_size": 16,
    }
    values.update(overrides)
    return Scheduler(SchedulerConfig(**values), cost)  # type: ignore[arg-type]


def run(scheduler: Scheduler) -> list[Step]:
    steps = []
    while (step := scheduler.step()) is not None:
        steps.append(step)
    return steps


def test_prefill_then_one_token_per_decode_step(cost: CostModel) -> None:
    scheduler = make(cost)
    scheduler.add("a", prompt_len=100, max_output=3)
    steps = run(scheduler)
    assert [[(w.num_new, w.is_prefill) for w in s.work] for s in steps] == [
        [(100, True)],
        [(1, False)],
        [(1, False)],
    ]
    assert [t.index for s in steps for t in s.tokens] == [0, 1, 2]
    assert steps[-1].tokens[0].finished
    assert scheduler.free_blocks == 1000  # freed on finish


def test_requests_past_max_num_seqs_wait_in_fifo_order(cost: CostModel) -> None:
    scheduler = make(cost, max_num_seqs=2)
    for name in "abc":
        scheduler.add(name, prompt_len=10, max_output=3)
    first = scheduler.step()
    assert first is not None
    assert {w.request_id for w in first.work} == {"a", "b"}
    assert first.num_waiting == 1 and first.first_scheduled == ("a", "b")
    steps = run(scheduler)
    # c joins only once a slot frees, in the step after a and b finish.
    joined = next(s for s in steps if "c" in s.first_scheduled)
    assert all(w.request_id == "c" for w in joined.work)


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decodes_going(cost: CostModel) -> None:
    scheduler = make(cost, max_num_batched_tokens=512)
    scheduler.add("short", prompt_len=8, max_output=10)
    scheduler.step()  # short's prefill
    scheduler.add("long", prompt_len=1200, max_output=1)
    steps = run(scheduler)
    long_chunks = [w.num_new for s in steps for w in s.work if w.request_id == "long"]
    assert long_chunks == [511, 511, 178]  # budget 512 minus the decode's one token
    for step in steps[:3]:
        assert any(w.request_id == "short" and not w.is_prefill for w in step.work)


def test_without_chunked_prefill_a_long_prompt_runs_whole_and_stalls_decodes(
    cost: CostModel,
) -> None:
    scheduler = make(cost, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    scheduler.add("short", prompt_len=8, max_output=10)
    scheduler.step()
    scheduler.add("long", prompt_len=4000, max_output=1)
    step = scheduler.step()
    assert step is not None
    assert [(w.request_id, w.num_new) for w in step.work] == [("short", 1), ("long", 4000)]
    plain = cost.decode_step_s(1, 9)
    assert step.duration_s > 20 * plain  # everyone's next token waits for the whole prefill


def test_a_whole_prefill_waits_when_the_budget_is_taken(cost: CostModel) -> None:
    scheduler = make(cost, enable_chunked_prefill=False, max_num_batched_tokens=100)
    scheduler.add("a", prompt_len=60, max_output=2)
    scheduler.add("b", prompt_len=60, max_output=2)
    step = scheduler.step()
    assert step is not None
    assert [w.request_id for w in step.work] == ["a"]


def test_full_kv_cache_makes_requests_wait(cost: CostModel) -> None:
    scheduler = make(cost, num_kv_blocks=10)  # 160 tokens
    scheduler.add("a", prompt_len=100, max_output=2)
    scheduler.add("b", prompt_len=100, max_output=2)
    step = scheduler.step()
    assert step is not None
    assert [w.request_id for w in step.work] == ["a"] and step.num_waiting == 1
    assert step.kv_usage == pytest.approx(0.7)


def test_preemption_when_a_running_sequence_cannot_grow(cost: CostModel) -> None:
    scheduler = make(cost, num_kv_blocks=4)  # 64 tokens of KV
    scheduler.add("a", prompt_len=30, max_output=20)
    scheduler.add("b", prompt_len=30, max_output=20)
    steps = run(scheduler)
    preempted = [r for s in steps for r in s.preempted]
    assert preempted and preempted[0] == "b"  # the newest running sequence goes first
    assert scheduler.num_preemptions == len(preempted)
    # b recomputes its prompt and the tokens it already had, then finishes all 20.
    b_tokens = [t.index for s in steps for t in s.tokens if t.request_id == "b"]
    assert b_tokens == list(range(20))
    recompute = [w for s in steps for w in s.work if w.request_id == "b" and w.is_prefill]
    assert recompute[-1].num_new > 30
    assert scheduler.free_blocks == 4


def test_abort_frees_blocks_and_slot(cost: CostModel) -> None:
    scheduler = make(cost)
    scheduler.add("a", prompt_len=100, max_output=50)
    scheduler.step()
    assert scheduler.free_blocks < 1000
    assert scheduler.abort("a")
    assert scheduler.free_blocks == 1000 and not scheduler.has_work()
    assert not scheduler.abort("a")
