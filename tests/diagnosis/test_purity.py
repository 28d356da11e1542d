"""The diagnosis core imports no web framework, database, HTTP client or clock; the engine
parser and window summary none either. Checked on the source, so a new import cannot slip in."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[2] / "app" / "phasewatch"
SHELL = {"service.py", "metrics.py"}  # the diagnosis package's I/O shell and its gauges
CORE = sorted(p for p in (APP / "diagnosis").glob("*.py") if p.name not in SHELL)
PURE_ENGINE = [APP / "engine" / name for name in ("parser.py", "window.py", "codec.py")]
FORBIDDEN = {"fastapi", "starlette", "sqlalchemy", "aiohttp", "httpx", "asyncio", "time",
             "datetime", "uvicorn", "socket", "phasewatch.store", "phasewatch.api",
             "phasewatch.proxy", "phasewatch.engine.scraper", "phasewatch.main"}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", CORE + PURE_ENGINE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_pure_modules_import_nothing_impure(path: Path) -> None:
    bad = {name for name in imported(path)
           if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)}
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_the_core_is_most_of_the_package() -> None:
    assert {p.name for p in CORE} >= {"diagnose.py", "statistics.py", "compare.py",
                                      "observations.py", "prompt_adjust.py", "stalls.py",
                                      "verdicts.py"}
