"""The benchmark scripts still run end to end (their --quick modes). No figure is asserted here:
speed is judged by running the scripts themselves, not by timed tests."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_proxy_ab_quick(tmp_path: Path) -> None:
    result = run("proxy_ab.py", tmp_path, "--variant", "nodiag:PHASEWATCH_DIAGNOSIS_INTERVAL_S=0")
    runs, summary = result["runs"], result["summary"]
    assert isinstance(runs, list) and [run["first"] for run in runs] == ["A", "B"]
    assert all(run[build]["ok"] == run[build]["scheduled"] > 0 for run in runs for build in "AB")
    assert isinstance(summary, dict) and summary["errors"] == 0 and summary["cpu_ratio"] > 0


def test_proxy_ab_against_nginx_quick(tmp_path: Path) -> None:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        pytest.skip("nginx is not installed")
    result = run("proxy_ab.py", tmp_path, "--nginx", nginx)
    assert str(result["compared"]).startswith("this checkout (B) against nginx")
    runs = result["runs"]
    assert isinstance(runs, list) and len(runs) == 2
    assert all(run[build]["ok"] == run[build]["scheduled"] > 0 for run in runs for build in "AB")
    assert all(run[build]["cpu_us_per_chunk"] > 0 for run in runs for build in "AB")


def test_connection_cost_quick(tmp_path: Path) -> None:
    result = run("connection_cost.py", tmp_path)
    rounds, summary = result["rounds"], result["summary"]
    assert isinstance(rounds, dict) and isinstance(summary, dict)
    assert rounds["phasewatch"] and summary["phasewatch"]["kept_alive_us"] > 0
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
        assert summary["nginx"]["kept_alive_us"] > 0


def test_opcode_census_quick(tmp_path: Path) -> None:
    result = run("opcode_census.py", tmp_path)
    requests, per_request = result["requests"], result["opcodes_per_request"]
    assert isinstance(requests, int) and requests > 0
    assert isinstance(per_request, float) and per_request > 0
    functions = result["functions"]
    assert isinstance(functions, list) and functions
    # The relay's own code is traced (the sitecustomize reached phasewatch's process).
    assert any(str(f["where"]).startswith("phasewatch/proxy/") for f in functions)


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


def test_read_path_quick() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "read_path.py"), "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert set(lines) == {"pass-through", "phasewatch"}
    assert "us per read" in lines["phasewatch"] and "x pass-through" in lines["phasewatch"]


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
