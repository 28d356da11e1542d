"""The benchmark scripts still run end to end (their --quick modes). No figure is asserted here:
speed is judged by running the scripts themselves, not by timed tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The benchmarks pace their own loads in real time: alone on the cores (`make test`).
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parent.parent


def run(script: str, tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--json", str(out), *args],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return dict(json.loads(out.read_text()))


def test_proxy_overhead_quick(tmp_path: Path) -> None:
    result = run("proxy_overhead.py", tmp_path, "--variant",
                 "nodiag:PHASEWATCH_DIAGNOSIS_INTERVAL_S=0", "--stored-rate", "1")
    text = json.dumps(result)
    assert "phasewatch" in text and "direct" in text and "pw:nodiag" in text


def test_store_scale_quick(tmp_path: Path) -> None:
    result = run("store_scale.py", tmp_path)
    writer, stats = result["writer"], result["stats"]
    assert isinstance(writer, list) and {row["backend"] for row in writer} == {"sqlite", "postgres"}
    assert all(row["dropped"] == 0 for row in writer)
    assert isinstance(stats, list) and all(row["rows"] == 50_000 for row in stats)
    diagnosis = result["diagnosis"]
    assert isinstance(diagnosis, list) and {row["backend"] for row in diagnosis} == {"sqlite",
                                                                                   "postgres"}
    # Three models in the span, each judged, and the round's statements timed.
    assert all(row["models"] == 3 and row["cpu_ms_per_round"] > 0 and row["statements"]
               for row in diagnosis)


def test_ttft_truth_quick(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ttft_truth.py"), "--quick", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "client - phasewatch" in result.stdout and "joined/sent" in result.stdout
    assert "summary" in json.loads(out.read_text())


def test_slow_client_quick(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "slow_client.py"), "--quick", "--json",
         str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(row["chunks_alone"] > 0 and row["chunks_beside"] > 0 for row in rows)


def test_ttft_truth_burst_quick(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ttft_truth.py"), "--quick", "--burst", "16",
         "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["joined"] == summary["sent"] == 16


def test_diagnosis_round_quick(tmp_path: Path) -> None:
    result = run("diagnosis_round.py", tmp_path)
    side = result["this checkout"]
    assert isinstance(side, dict) and side["rounds"] == 5 and side["median_ms"] > 0


def test_plan_accuracy_quick(tmp_path: Path) -> None:
    result = run("plan_accuracy.py", tmp_path)
    rows = result["rows"]
    assert isinstance(rows, list) and len(rows) == 4  # one preset, four loads
    assert all(row["measured_ms"]["itl_p50"] > 0 and row["predicted_ms"]["itl_p50"] > 0
               for row in rows)


def test_headroom_ramp_quick(tmp_path: Path) -> None:
    result = run("headroom_ramp.py", tmp_path)
    headroom = result["headroom"]
    assert isinstance(headroom, list) and headroom  # the proxy exported it, and it was read
    top = result["top_rps"]
    assert isinstance(top, float) and top > 0
