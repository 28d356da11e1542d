"""The diagnosis schedule in front of a real vLLM whose decode batch grows under its cap.

The shortened form of `benchmarks/diagnosis_onsets.py --engine vllm --onset-scenario
decode_saturation` (docs/diagnosis.md has the full table): 2 users for 90 s (the schedule
compares with the span before its 60 s window, so it needs a healthy span that long first),
then 32 for 90 s. The
engine reports nothing waiting while TTFT rises with ITL, so the verdict must be
decode_saturation, named within a minute of the onset, never queueing before it, and held to
the end on every surface: the verdict gauge, the default `GET /api/diagnosis` and the history,
read every second.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from benchmarks.diagnosis_onsets import (
    PROXY_ENV,
    TARGET_S,
    VLLM_ONSETS,
    describe,
    run_onset,
)
from benchmarks.diagnosis_scenarios import Stack, start_proxy, wait_http
from tests.vllm.server import VLLMServer

LEAD_S, FAULT_S = 90.0, 90.0


def test_decode_saturation_is_named_once_and_held_on_every_surface(
        vllm_server: VLLMServer, tmp_path: Path) -> None:
    full = VLLM_ONSETS["decode_saturation"]
    onset = replace(full, lead=replace(full.lead, seconds=LEAD_S),
                    fault=replace(full.fault, seconds=FAULT_S))
    url, proc = start_proxy(vllm_server.url, tmp_path, onset.name, PROXY_ENV)
    try:
        wait_http(url + "/api/health", proc)
        timeline = asyncio.run(run_onset(
            Stack(onset, vllm_server.url, url, [proc], model=vllm_server.model)))
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    seen = describe(timeline)
    right = timeline.time_to_correct
    assert right is not None and right <= TARGET_S, seen
    assert not timeline.wrong_before_correct(), seen
    assert timeline.changes_after_correct() == 0, seen
    assert not timeline.disagree, seen
    assert timeline.agree >= FAULT_S / 2, seen  # the surfaces were read through the incident
