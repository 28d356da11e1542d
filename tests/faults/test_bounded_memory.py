"""Ordinary traffic leaves nothing behind: `phasewatch serve`'s memory and descriptors over
thousands of streamed requests on kept connections (benchmarks/memory_growth.py, its quick
form: 3,000 requests, the native relay on). The full form (40,000) is in docs/benchmarks.md.

A leak of the size once found (13.7 KB per request, a cycle the collector could not see)
would grow it by about 33 MB here; the bound leaves room for caches that fill once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_rss_and_descriptors_stay_flat_over_thousands_of_requests(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "memory_growth.py"), "--quick",
         "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["growth_mb"] < 8, figures
    assert figures["end_fds"] <= figures["warm_fds"], figures
