"""README, "The API": its commands and its Python, as written there, run against a real proxy.

The fenced blocks of that section are taken from the README and run (a shell block in bash,
a Python block in a fresh interpreter) against the proxy of tests/api/conftest.py, with the
admin token in `PHASEWATCH_ADMIN_TOKEN` as the section says; what they print is checked
against the API's own answers and schema. So the README cannot go stale.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.api.conftest import TOKEN, Served
from tests.api.openapi_check import ApiSchema
from tests.support.readme import blocks


def section_blocks() -> dict[str, list[str]]:
    """The fenced blocks of "## Integrations" > "### The API", by language."""
    return {language: blocks("The API", language) for language in ("sh", "python")}


def run(args: list[str], served: Served, cwd: Path) -> str:
    env = {**os.environ, "PHASEWATCH_URL": served.url, "PHASEWATCH_ADMIN_TOKEN": TOKEN}
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{args[0]} failed ({done.returncode}):\n{done.stderr}"
    return done.stdout


def test_the_section_has_a_shell_and_a_python_block() -> None:
    blocks = section_blocks()
    assert len(blocks.get("sh", [])) == 1 and len(blocks.get("python", [])) == 1, blocks.keys()


def test_the_curl_commands(served: Served, tmp_path: Path) -> None:
    (script,) = section_blocks()["sh"]
    out = run(["bash", "-e", "-o", "pipefail", "-c", script], served, tmp_path)
    # The saved document is the one the API answers with; each command printed one answer,
    # which matches the schema of its path.
    api = ApiSchema(json.loads((tmp_path / "phasewatch-openapi.json").read_text()))
    assert api.doc == served.get("/openapi.json").json()
    answers = [json.loads(line) for line in out.splitlines()]
    paths = re.findall(r"\$PHASEWATCH_URL(/api/[a-z/]+)", script)
    assert paths == ["/api/stats", "/api/requests", "/api/diagnosis"]
    for path, answer in zip(paths, answers, strict=True):
        assert api.problems(answer, api.answer(path, 200)) == [], path
    stats, errors, diagnosis = answers
    assert {g["group"] for g in stats["groups"]} == {served.model, "no-such-model"}
    assert {r["outcome"] for r in errors["items"]} == {"http_error"}
    assert [d["model"] for d in diagnosis["items"]] == [served.model]


def test_the_curl_commands_need_the_token(served: Served, tmp_path: Path) -> None:
    (script,) = section_blocks()["sh"]
    env = {**os.environ, "PHASEWATCH_URL": served.url, "PHASEWATCH_ADMIN_TOKEN": "wrong"}
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "401" in done.stderr


def test_the_python_pagination(served: Served, tmp_path: Path) -> None:
    (code,) = section_blocks()["python"]
    out = run([sys.executable, "-c", code], served, tmp_path)
    records = served.records
    timed = sum(1 for r in served.get("/api/requests", limit=1000).json()["items"]
                if r["ttft_s"] is not None)
    assert out.splitlines()[0] == f"{records} requests, {timed} with a first token"
    assert re.fullmatch(r"TTFT p50 \d+\.\d{3} s", out.splitlines()[1])
