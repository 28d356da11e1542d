"""The load generator capacity benchmark still runs end to end (its --quick mode). No latency
is asserted: the figures come from running the script itself (docs/bench.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_loadgen_capacity_quick(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "loadgen_capacity.py"), "--quick", "--json",
         str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["intervals"]
    summary = row["summary"]
    assert summary["errors"] == 0 and summary["concurrency_max"] == 64
    for level in row["runs"][0]["levels"].values():
        assert level["ok"] == level["streams"] and level["steady_chunks"] > 0
        assert level["chunks"] == level["streams"] * 20  # every chunk of every stream read
    assert "added p50" in done.stdout and row["chunks_per_s"] == 640
