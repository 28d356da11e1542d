"""`phasewatch runs list|show|compare` on stored runs, and the bench against other targets:
one without `/tokenize` (approximate or locally counted prompts), and none at all."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from phasewatch.bench.result import RunResult, from_json
from phasewatch.cli import main
from tests.bench.conftest import Bench
from tests.support.servers import ThreadServer, free_port


def test_runs_show_prints_the_report_the_bench_printed_and_compare_finds_what_moved(
    bench: Bench, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = ("prompt", "--prompt-tokens", "64", "1024", "--max-tokens", "8", "--requests", "1",
             "--repeats", "2", "--no-plots")
    printed_a, a = bench.bench(capsys, "article", *sweep)
    _, b = bench.bench(capsys, "capped", *sweep)
    a_id, b_id = a.run["id"], b.run["id"]

    code, shown, _ = bench.run(capsys, "runs", "show", a_id[:-2])  # a unique start of the id
    assert code == 0 and printed_a.startswith(shown)
    code, exported, _ = bench.run(capsys, "runs", "show", a_id, "--json")
    assert code == 0 and from_json(exported.encode()).points == a.points
    code, listed, _ = bench.run(capsys, "runs", "list", "--kind", "prompt")
    assert code == 0 and a_id in listed and b_id in listed

    code, compared, _ = bench.run(capsys, "runs", "compare", a_id, b_id)
    assert code == 0
    # B's simulator has half the MFU: prefill, and so TTFT, takes longer; decode does not.
    assert "mfu: 0.22 -> 0.11" in compared and "max_num_seqs: 256 -> 2" in compared
    row = next(line for line in compared.splitlines()
               if line.startswith("prompt_tokens 1024 ") and "TTFT p50" in line)
    assert row.rstrip().endswith(" moved"), row
    ratio = float(row.split("|")[1].split()[-1])
    assert ratio > 1.3
    # The summary lists the moves largest first. On a loaded machine one repeat's decode can
    # stall (ITL p99 of 7 gaps), so what leads is not fixed; the order and the cut-off are.
    summary = next(line for line in compared.splitlines()
                   if line.startswith("moved beyond the noise, largest first: "))
    listed = [(entry.rsplit(" (x", 1)[0], float(entry.rsplit(" (x", 1)[1].rstrip(")")))
              for entry in summary.split(": ", 1)[1].split("; ") if " (x" in entry]
    sizes = [abs(r - 1.0) for _, r in listed]
    assert listed and sizes == sorted(sizes, reverse=True), summary
    assert any(name.startswith("prompt_tokens 1024 TTFT p50 ") for name, _ in listed) or (
        len(listed) == 8 and min(sizes) >= round(ratio, 2) - 1.0), summary

    code, _, err = bench.run(capsys, "runs", "show", "no-such-run")
    assert code == 1 and "no run with an id starting 'no-such-run'" in err


def fake_engine(prompt_tokens: Any) -> FastAPI:
    """An OpenAI-compatible server with no /tokenize whose tokenizer counts words, plus one
    (a BOS token, say) if `prompt_tokens` says so: what the bench cannot know without asking."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"data": [{"id": "fake", "max_model_len": 4096}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        prompt = prompt_tokens(body["prompt"])

        async def stream() -> AsyncIterator[bytes]:
            for _ in range(body["max_tokens"]):
                yield b"data: " + orjson.dumps({"choices": [{"index": 0, "text": " w"}]}) + b"\n\n"
            usage = {"prompt_tokens": prompt, "completion_tokens": body["max_tokens"]}
            yield b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def run_no_store(capsys: pytest.CaptureFixture[str], url: str, out: Path,
                 *args: str) -> tuple[str, dict[str, Any]]:
    capsys.readouterr()
    code = main(["bench", "prompt", "--url", url, "--no-store", "--quiet", "--no-plots",
                 "--out", str(out), "--prompt-tokens", "32", "--max-tokens", "3",
                 "--requests", "2", *args])
    printed = capsys.readouterr().out
    assert code == 0, printed
    (export,) = out.glob("*.json")
    return printed, json.loads(export.read_text())


def test_without_tokenize_prompt_lengths_are_labelled_approximate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = ThreadServer(fake_engine(lambda text: len(text.split()) + 1)).start()
    try:
        printed, export = run_no_store(capsys, server.url, tmp_path)
    finally:
        server.stop()
    assert "prompts: APPROXIMATE lengths" in printed
    assert "~tokens" in printed
    assert export["run"]["parameters"]["prompt_tokens_by"] == "estimate"
    assert export["run"]["summary"]["approximate_prompts"] is True
    (point,) = export["points"]
    # What the server counted (its usage) is what the estimate could not know: one more.
    assert point["extra"]["figures"]["prompt_tokens"] == 2 * 33
    assert point["errors"] == 0 and "proxy" not in point["extra"]  # not through phasewatch


def test_a_local_tokenizer_makes_prompts_exact_without_tokenize(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    local = tokenizers.Tokenizer(tokenizers.models.WordLevel({"word": 0, "[UNK]": 1}, "[UNK]"))
    local.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    local.save(str(tmp_path / "tokenizer.json"))
    server = ThreadServer(fake_engine(lambda text: len(text.split()))).start()
    try:
        printed, export = run_no_store(capsys, server.url, tmp_path / "out",
                                       "--tokenizer", str(tmp_path))
    finally:
        server.stop()
    assert "exact token counts, by a local tokenizer" in printed
    assert export["run"]["parameters"]["prompt_tokens_by"] == "local"
    assert export["points"][0]["extra"]["figures"]["prompt_tokens"] == 2 * 32


def test_an_unreachable_target_fails_with_a_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code = main(["bench", "concurrency", "--url", url, "--no-store", "--quiet",
                 "--out", str(tmp_path)])
    assert code == 1
    assert f"connection refused at {url}: nothing is listening there" in (
        capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


def test_chunked_prefill_is_switched_only_on_the_simulator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = ThreadServer(fake_engine(lambda text: len(text.split()))).start()
    try:
        capsys.readouterr()
        code = main(["bench", "interference", "--url", server.url, "--no-store", "--quiet",
                     "--no-plots", "--out", str(tmp_path), "--chunked-prefill", "both"])
        err = capsys.readouterr().err
    finally:
        server.stop()
    assert code == 1
    assert "--chunked-prefill both switches phasewatch's simulator" in err
    assert "--no-enable-chunked-prefill" in err and "runs compare" in err


class Interrupt:
    """A progress display that presses Ctrl-C after the first finished step."""

    def start(self, total: int | None, description: str, at_most: bool = False) -> None:
        pass

    def revise(self, total: int, at_most: bool) -> None:
        pass

    def advance(self, label: str) -> None:
        raise KeyboardInterrupt

    def stop(self) -> None:
        pass


def test_a_run_that_breaks_off_is_stored_as_failed_with_what_it_measured(tmp_path: Path) -> None:
    from phasewatch.bench.modes import PromptSweep
    from phasewatch.bench.runner import BenchOptions, run_bench
    from phasewatch.bench.storage import RunStore

    database_url = f"sqlite+aiosqlite:///{tmp_path / 'runs.db'}"
    options = BenchOptions("", PromptSweep((16, 32), max_tokens=2, requests=1), run_id="cut")

    async def cut_short(url: str) -> RunResult:
        async with RunStore(database_url) as store:
            with pytest.raises(KeyboardInterrupt):
                await run_bench(replace(options, url=url), store, Interrupt())
            return await store.load("cut")

    server = ThreadServer(fake_engine(lambda text: len(text.split()))).start()
    try:
        stored = asyncio.run(cut_short(server.url))
    finally:
        server.stop()
    assert stored.run["status"] == "failed" and stored.run["finished_at"] is not None
    assert stored.run["summary"]["error"].startswith("KeyboardInterrupt")
    (point,) = stored.points  # the first prompt length was measured, the second never was
    assert point["x_value"] == 16 and point["requests"] == 1 and point["errors"] == 0


def test_without_the_bench_extra_it_still_runs_and_says_the_plots_were_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    monkeypatch.setitem(sys.modules, "rich", None)
    server = ThreadServer(fake_engine(lambda text: len(text.split()))).start()
    try:
        capsys.readouterr()
        code = main(["bench", "prompt", "--url", server.url, "--no-store", "--out",
                     str(tmp_path), "--prompt-tokens", "8", "--max-tokens", "2",
                     "--requests", "1"])
        captured = capsys.readouterr()
    finally:
        server.stop()
    assert code == 0
    assert "plots skipped: matplotlib is not installed (pip install 'phasewatch[bench]')" in (
        captured.out)
    assert "[1/1] prompt_tokens 8, repeat 1 of 1" in captured.err  # plain progress lines
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]
