"""The real-vLLM accuracy benchmark's offline report of how a kept run's requests arrived and
ended together (benchmarks/plan_accuracy_vllm.py `arrival_structure`), on a kept directory
written by hand: the figures docs/plan.md quotes are counted as it says."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

from benchmarks.plan_accuracy_vllm import arrival_structure, flushes


def _kept(directory: Path, rows: list[tuple[str, str, float, float]]) -> Path:
    with closing(sqlite3.connect(directory / "plan.db")) as db:
        db.execute("CREATE TABLE requests (run_id TEXT, started_at TEXT, e2e_s REAL, "
                   "itl_max_s REAL, outcome TEXT)")
        db.executemany("INSERT INTO requests VALUES (?, ?, ?, ?, 'ok')", rows)
        db.execute("INSERT INTO requests VALUES ('users-8', '2026-12-08T00:00:09.000Z', 1.0, "
                   "0.01, 'http_error')")  # not counted: not ok
        db.commit()
    (directory / "truth.json").write_text(json.dumps({
        "2": {"ttft_s": [], "gaps_s": [0.0001, 0.005, 0.006, 0.007], "requests": 3,
              "seconds": 10, "warmup": 0.5},
        "8": {"ttft_s": [], "gaps_s": [0.01], "requests": 5, "seconds": 10, "warmup": 0.0,
              "ends": [[7.0, 0.2], [7.001, 0.2005], [7.0015, 0.2], [9.0, 0.1]]}}))
    return directory


def at(seconds: float) -> str:
    return f"2026-12-08T00:00:{seconds:06.3f}Z"


def test_arrivals_together_and_flushes_are_counted_after_the_warm_up(tmp_path: Path) -> None:
    kept = _kept(tmp_path, [
        # Calibration: the first is warm-up; then two within 1 ms, one alone.
        ("calibrate", at(0.0), 0.5, 0.01),
        ("calibrate", at(1.0), 0.5, 0.01),
        ("calibrate", at(1.001), 0.7, 0.01),
        ("calibrate", at(3.0), 0.5, 0.01),
        # 8 users: three end together at 2.0 s after the same 300 ms gap (a flush), a fourth
        # ends with them after another gap, and a fifth ends alone.
        ("users-8", at(0.0), 2.0, 0.300),
        ("users-8", at(0.5), 1.5, 0.3005),
        ("users-8", at(1.0), 1.0005, 0.301),
        ("users-8", at(1.2), 0.8, 0.050),
        ("users-8", at(5.0), 1.0, 0.300),
    ])
    got = arrival_structure(kept)
    assert got["calibrate"] == {"requests": 3, "arrived_together": 2 / 3, "most_together": 2,
                                "flushes": 0, "client_gaps_under_0_5ms": 0.25}
    assert got["users-8"]["requests"] == 5
    assert got["users-8"]["arrived_together"] == 0
    assert got["users-8"]["most_together"] == 1
    assert got["users-8"]["flushes"] == 1
    assert got["users-8"]["client_flushes"] == 1  # the clients' own (end, longest gap)
    assert "client_flushes" not in got["calibrate"]  # kept before clients recorded them


def test_a_flush_needs_three_ends_together_after_the_same_gap() -> None:
    assert flushes([(1.0, 0.3), (1.001, 0.3), (1.002, 0.301), (1.0035, 0.3)]) == [(4, 0.3)]
    assert flushes([(1.0, 0.3), (1.001, 0.3)]) == []  # two are not a flush
    assert flushes([(1.0, 0.3), (1.001, 0.1), (1.002, 0.3)]) == []  # not the same gap
    assert flushes([(1.0, 0.3), (1.001, 0.3), (1.01, 0.3)]) == []  # not together
    assert flushes([(5.0, 0.2), (5.0, 0.2), (5.0, 0.2), (1.0, 0.3), (1.0, 0.3),
                    (1.0, 0.3)]) == [(3, 0.3), (3, 0.2)]  # in time order
