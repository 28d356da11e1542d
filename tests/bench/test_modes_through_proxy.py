"""Every bench mode end to end: simulator -> phasewatch -> `phasewatch bench`, stored and shown.

Each test runs the CLI in this process against a stack from conftest.py and checks three
things: the shape the article predicts (model time; expected figures from docs/simulator.md),
phasewatch's own records of the same requests beside the client's, and that the run's figures
are the same in the printed report, the JSON export and the database.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from phasewatch.bench.render import render
from phasewatch.bench.result import POINT_COLUMNS, RunResult
from tests.bench.conftest import Bench


def assert_one_run_everywhere(bench: Bench, printed: str, exported: RunResult) -> RunResult:
    """JSON export == database == printed report, to the last digit stored."""
    stored = bench.stored(exported.run["id"])
    assert stored.run == exported.run
    assert stored.points == exported.points
    report = render(stored.run, stored.points)
    assert printed.startswith(report)
    assert render(exported.run, exported.points) == report
    # And the printed cells are the stored numbers, not just the same rendering of something.
    first = min(stored.points, key=lambda p: p["step"])
    row = next(line for line in report.splitlines()
               if line.lstrip().startswith(f"{first['x_value']:g} |")
               or line.lstrip().startswith(f"{first['extra'].get('phase')} "))
    cells = re.split(r"[\s|]+", row.strip())
    if first["ttft_p50_s"] is not None:
        assert f"{first['ttft_p50_s'] * 1e3:.1f}" in cells
    assert f"{first['itl_p50_s'] * 1e3:.2f}" in cells
    assert set(first) == set(POINT_COLUMNS)
    return stored


def ms(value: Any) -> float:
    assert value is not None
    return float(value) * 1e3


def by_x(run: RunResult) -> dict[float, dict[str, Any]]:
    return {p["x_value"]: p for p in run.points}


def test_prompt_sweep_ttft_grows_with_the_prompt_and_itl_stays_flat(
    bench: Bench, capsys: pytest.CaptureFixture[str]
) -> None:
    printed, run = bench.bench(capsys, "article", "prompt", "--prompt-tokens", "64", "512",
                               "2048", "--max-tokens", "16", "--requests", "2", "--repeats", "2")
    stored = assert_one_run_everywhere(bench, printed, run)
    points = by_x(stored)
    assert stored.run["status"] == "finished" and stored.run["kind"] == "prompt"
    assert stored.run["parameters"]["prompt_tokens_by"] == "server"
    assert stored.run["parameters"]["time_scale"] == 2.0
    assert stored.run["engine"]["sim"]["enable_chunked_prefill"] is False
    assert stored.run["engine"]["via_phasewatch"]["upstream"] == bench.stacks["article"].sim_url
    for n, point in points.items():
        assert point["requests"] == 4 and point["errors"] == 0
        # /tokenize made every prompt exact: usage says n prompt tokens for each request.
        assert point["extra"]["figures"]["prompt_tokens"] == 4 * n
        assert point["extra"]["figures"]["output_tokens"] == 4 * 16
        assert len(point["extra"]["repeats"]) == 2 and "ttft_p50_s" in point["extra"]["spread"]
        proxy = point["extra"]["proxy"]
        assert proxy["requests"] == 4 and proxy["errors"] == 0
        # phasewatch's clock starts after the client's and stops when it reads the token, so
        # its TTFT sits a little inside the client's (the hop, the proxy's parsing).
        assert 0 < ms(point["ttft_p50_s"]) - ms(proxy["ttft_s"]["p50"]) < 10
        assert abs(ms(point["itl_p50_s"]) - ms(proxy["itl_p50_s"]["p50"])) < 0.3
    ttft = {n: ms(p["ttft_p50_s"]) for n, p in points.items()}
    itl = [ms(p["itl_p50_s"]) for p in points.values()]
    # Model: TTFT ~42 / ~80 / ~200 ms, ITL 9.65..9.75 ms.
    assert ttft[64] < ttft[512] < ttft[2048]
    assert ttft[2048] > 3.5 * ttft[64]
    assert max(itl) / min(itl) < 1.05
    assert 9.3 < min(itl) and max(itl) < 10.5
    assert (bench.out / f"{stored.run['id']}.png").stat().st_size > 10_000
    # The bench shares the proxy's store: phasewatch's own API serves the run it measured.
    served = httpx.get(f"{bench.stacks['article'].proxy_url}/api/runs/{stored.run['id']}").json()
    assert served["status"] == "finished" and len(served["points"]) == 3
    assert [p["ttft_p50_s"] for p in served["points"]] == [
        p["ttft_p50_s"] for p in sorted(stored.points, key=lambda p: p["step"])]


def test_concurrency_sweep_raises_itl_a_little_and_throughput_a_lot(
    bench: Bench, capsys: pytest.CaptureFixture[str]
) -> None:
    printed, run = bench.bench(capsys, "article", "concurrency", "--concurrency", "1", "16",
                               "64", "--prompt-tokens", "256", "--max-tokens", "32")
    stored = assert_one_run_everywhere(bench, printed, run)
    points = by_x(stored)
    itl = {c: ms(p["itl_p50_s"]) for c, p in points.items()}
    tput = {c: p["output_throughput_tps"] for c, p in points.items()}
    ttft = {c: ms(p["ttft_p50_s"]) for c, p in points.items()}
    for c, point in points.items():
        assert point["requests"] == c and point["errors"] == 0
        assert point["extra"]["proxy"]["requests"] == c
        # The concurrency achieved, not the one asked for: every stream was open at once.
        assert point["extra"]["figures"]["concurrency_max"] == c
        assert point["concurrency"] > 0.75 * c
    # Model (256-token prompts, 32 tokens): ITL 9.7 -> ~10.9 ms; throughput ~90 -> ~2500 tok/s.
    assert itl[1] < itl[16] < itl[64] < 1.5 * itl[1]
    assert itl[64] > 1.05 * itl[1]
    assert tput[1] < tput[16] < tput[64] and tput[64] > 10 * tput[1]
    assert ttft[1] < ttft[16] < ttft[64]


def test_interference_a_long_prefill_stalls_the_short_stream_without_chunking(
    bench: Bench, capsys: pytest.CaptureFixture[str]
) -> None:
    printed, run = bench.bench(capsys, "article", "interference", "--long-prompt-tokens", "8000",
                               "--short-max-tokens", "160", "--before-s", "0.3", "--after-s",
                               "0.3")
    stored = assert_one_run_everywhere(bench, printed, run)
    before, during, after = sorted(stored.points, key=lambda p: p["step"])
    assert [p["extra"]["phase"] for p in (before, during, after)] == ["before", "during", "after"]
    assert all(p["errors"] == 0 for p in stored.points)
    summary = stored.run["summary"]
    # Model, chunked prefill off: the 8000-token prefill is one ~750 ms step; every decode
    # waits for it. Before and after, a step is ~10 ms.
    assert 650 < ms(summary["long_ttft_s"]) < 950
    stall = ms(during["extra"]["itl_max_s"])
    assert stall > 600 and stall > 40 * ms(before["itl_p50_s"])
    assert ms(before["itl_p50_s"]) < 11 and ms(after["itl_p50_s"]) < 11
    assert ms(before["itl_p99_s"]) < 30 and ms(after["itl_p99_s"]) < 30
    # phasewatch saw the same stall and the same long prefill.
    proxy = during["extra"]["proxy"]
    assert abs(ms(proxy["itl_max_s"]) - stall) < 0.05 * stall
    assert abs(ms(proxy["long_ttft_s"]["p50"]) - ms(summary["long_ttft_s"])) < 10
    # The timeline behind the plot: the stalled gap ends after the long prompt's first token.
    (timeline,) = summary["timelines"]
    biggest = max(timeline["gaps"], key=lambda gap: gap[1])
    assert biggest[1] * 1e3 == pytest.approx(stall)
    assert biggest[0] >= timeline["long_first_token_s"] - 0.002
    assert "during" in printed and "the long prompt's TTFT" in printed


def test_rate_sweep_with_poisson_arrivals_queues_past_capacity(
    bench: Bench, capsys: pytest.CaptureFixture[str]
) -> None:
    printed, run = bench.bench(capsys, "capped", "rate", "--rates", "4", "40", "--requests",
                               "24", "--prompt-tokens", "64", "--max-tokens", "16",
                               "--slo-ttft-ms", "300", "--slo-itl-ms", "30")
    stored = assert_one_run_everywhere(bench, printed, run)
    low, high = by_x(stored)[4.0], by_x(stored)[40.0]
    # Two slots of ~0.25 s (model) each serve ~8 requests/s: 4/s flows, 40/s queues.
    assert ms(high["ttft_p50_s"]) > 3 * ms(low["ttft_p50_s"])
    assert high["concurrency"] > 2 * low["concurrency"]
    assert abs(ms(high["itl_p50_s"]) - ms(low["itl_p50_s"])) < 0.1 * ms(low["itl_p50_s"])
    assert low["extra"]["slo_met"] is True and high["extra"]["slo_met"] is False
    assert low["goodput_rps"] > 0.5 * 4 and high["goodput_rps"] < high["extra"]["figures"][
        "request_rps"]
    assert stored.run["summary"]["slo"]["quantile"] == "p95"


def test_goodput_search_finds_a_rate_that_meets_both_slos_and_one_just_above_that_does_not(
    bench: Bench, capsys: pytest.CaptureFixture[str]
) -> None:
    printed, run = bench.bench(capsys, "capped", "goodput", "--slo-ttft-ms", "150",
                               "--slo-itl-ms", "30", "--slo-quantile", "p90", "--start-rate",
                               "4", "--max-rate", "64", "--bisect-steps", "2", "--requests",
                               "20", "--prompt-tokens", "64", "--max-tokens", "16")
    stored = assert_one_run_everywhere(bench, printed, run)
    summary = stored.run["summary"]
    steps = {p["step"]: p for p in stored.points}
    best, missed = steps[summary["best_step"]], steps[summary["next_step"]]
    assert best["x_value"] == summary["best_rate"] < missed["x_value"] == summary["next_rate"]
    assert best["extra"]["slo_met"] is True and missed["extra"]["slo_met"] is False
    # One per-request definition: 90% of the requests had TTFT <= 150 ms and TPOT <= 30 ms.
    assert best["extra"]["figures"]["slo_attainment"] >= 0.9
    assert missed["extra"]["figures"]["slo_attainment"] < 0.9
    assert ms(best["ttft_p90_s"]) <= 150  # implied: 90% good means 90% within the TTFT
    # Doubling from 4 until a miss, then bisecting: the miss is within one doubling of the pass.
    # Two ~0.2 s (model) slots serve ~10 requests/s, so 4/s passes and 16/s queues.
    rates = [p["x_value"] for p in sorted(stored.points, key=lambda p: p["step"])]
    assert rates[0] == 4.0 and steps[0]["extra"]["slo_met"] is True
    assert missed["x_value"] <= 2 * best["x_value"]
    # The queue, not decode, is what breaks first on a 2-slot server.
    assert "TTFT" in " ".join(missed["extra"]["slo_misses"])
    assert "highest rate with 90% of requests good (TTFT <= 150 ms and TPOT <= 30.0 ms " \
           f"each): {best['x_value']:g} req/s" in printed
