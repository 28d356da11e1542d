"""Each diagnosis scenario once, end to end: the simulator with a known fault behind a real
proxy (both subprocesses), traffic through it, and the verdict phasewatch gives.

`benchmarks/diagnosis_scenarios.py` holds the scenarios and runs the repeats for the confusion
matrix; this runs each once, and the steady one as a long run judged over several windows (no
false alarm allowed). About two minutes on the 2-core development machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.diagnosis_scenarios import SCENARIOS, Stack, run_scenario, stacks


@pytest.fixture(scope="module")
def running() -> Iterator[dict[str, Stack]]:
    """Every scenario's simulator and proxy, started together once."""
    with stacks(list(SCENARIOS.values())) as started:
        yield started


@pytest.mark.parametrize("name", [name for name in SCENARIOS if name != "steady"])
async def test_each_fault_gets_its_verdict(running: dict[str, Stack], name: str) -> None:
    (outcome,) = await run_scenario(running[name], seed=7)
    evidence = outcome.report["evidence"]
    why = (f"{outcome.summary}\nchecks: {evidence['checks']}\nengine: {evidence['engine']}\n"
           f"simulator steps late by over 1 ms: {outcome.sim_late_steps}")
    assert outcome.verdict == outcome.expect, why
    assert outcome.confidence > 0.5, why
    checks = evidence["checks"]
    if name == "prefill_bound":
        assert checks["prompts_longer"] and not checks["request_rate_rising"]
    if name == "kv_pressure":
        assert evidence["engine"]["preemptions"] >= 1


async def test_steady_traffic_raises_no_alarm_over_a_long_run(running: dict[str, Stack]) -> None:
    outcomes = await run_scenario(running["steady"], seed=7, steady_windows=4)
    assert len(outcomes) == 4
    assert [o.verdict for o in outcomes] == ["healthy"] * 4, [o.summary for o in outcomes]
