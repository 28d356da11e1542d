"""A new user's first hour with `phasewatch bench` and `phasewatch runs`, as they meet it.

Every command runs as a subprocess (`python -m phasewatch.cli ...`), against the simulator
serving a 70 GiB+ preset in a subprocess of its own: H100 + Qwen2.5-0.5B, where vLLM's default
budget is 8,192 batched tokens, so the old 8,000-token long prompt fit in one step and chunked
prefill on and off showed the same stall. Two sequences at most (`--max-num-seqs 2`) make a
goodput search saturate it at a rate a few seconds reach; time-scale 2 keeps Python's per-chunk
costs small against the model's 2.4 ms steps. Each bench run happens once (module fixtures)
and each test checks several things on its output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from phasewatch.bench.plots import draw
from phasewatch.bench.result import RunResult, from_json
from phasewatch.cli import build_parser
from tests.support.servers import free_port, subprocess_server

REPO = Path(__file__).resolve().parents[2]
SIM = ("--gpu", "h100", "--max-num-seqs", "2", "--time-scale", "2", "--log-level", "warning")


@dataclass(frozen=True)
class User:
    """Runs `phasewatch ...` as a user would: a process of its own, in a directory of its own."""

    home: Path
    sim_url: str
    database_url: str

    def run(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PHASEWATCH_DATABASE_URL", "PHASEWATCH_ADMIN_TOKEN")}
        return subprocess.run([sys.executable, "-m", "phasewatch.cli", *args], cwd=cwd or self.home,
                              env=env, capture_output=True, text=True, timeout=120)

    def bench(self, mode: str, *args: str) -> tuple[str, str, RunResult]:
        """One bench run against the simulator, stored: its report, its stderr, its export."""
        done = self.run("bench", mode, "--url", self.sim_url, "--database-url",
                        self.database_url, "--out", str(self.home / "out"), *args)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        run_id = done.stdout.split("phasewatch runs show ")[-1].strip()
        return done.stdout, done.stderr, from_json((self.home / "out" / f"{run_id}.json")
                                                   .read_bytes())


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> Iterator[User]:
    home = tmp_path_factory.mktemp("first-hour")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with subprocess_server(["-m", "phasewatch.cli", "sim", "--port", str(port), *SIM],
                           url + "/health", cwd=home):
        yield User(home, url, f"sqlite+aiosqlite:///{home / 'runs.db'}")


@pytest.fixture(scope="module")
def interference(user: User) -> dict[str, tuple[str, RunResult]]:
    """Chunked prefill on and off in one command each: the default long prompt, and 8000."""
    short = ("--before-s", "0.1", "--after-s", "0.1", "--short-max-tokens", "200", "--quiet",
             "--no-plots", "--chunked-prefill", "both")
    default, _, a = user.bench("interference", *short, "--name", "stall, default prompt")
    old, _, b = user.bench("interference", *short, "--long-prompt-tokens", "8000",
                           "--name", "stall, 8000 tokens")
    return {"default": (default, a), "8000": (old, b)}


@pytest.fixture(scope="module")
def goodput(user: User) -> tuple[str, str, RunResult]:
    return user.bench("goodput", "--slo-ttft-ms", "100", "--slo-itl-ms", "5", "--slo-quantile",
                      "p90", "--start-rate", "16", "--max-rate", "128", "--bisect-steps", "2",
                      "--requests", "16", "--prompt-tokens", "64", "--max-tokens", "16",
                      "--no-plots")


def stalls(run: RunResult) -> dict[str, float]:
    """The short stream's longest gap during the long prefill, per setting, in model ms."""
    return {p["extra"]["chunked_prefill"]: p["extra"]["itl_max_s"] * 1e3 for p in run.points
            if p["extra"]["phase"] == "during"}


def test_interference_shows_what_chunked_prefill_changes_and_says_when_it_cannot(
    user: User, interference: dict[str, tuple[str, RunResult]]
) -> None:
    printed, run = interference["default"]
    assert [(p["extra"]["phase"], p["extra"]["chunked_prefill"]) for p in run.points] == [
        (phase, setting) for setting in ("on", "off") for phase in ("before", "during", "after")]
    assert all(p["errors"] == 0 for p in run.points) and run.run["summary"]["long_errors"] == 0
    # Sized from the budget: 4 x 8192, capped so that prompt and output fit max_model_len.
    assert run.run["parameters"]["long_prompt_tokens"] == 32768 - 4
    budgets = {v["chunked_prefill"]: v["max_num_batched_tokens"]
               for v in run.run["summary"]["variants"]}
    assert budgets == {"on": 8192, "off": 32768}
    # Model: a ~200 ms prefill in one step (off) against four chunks of at most ~75 ms (on).
    stall = stalls(run)
    before = next(p for p in run.points if p["extra"]["phase"] == "before")["itl_p50_s"] * 1e3
    assert stall["off"] > 2 * stall["on"] and stall["on"] > 10 * before
    assert "long prompt: 32768 tokens by default: 4 x the server's max_num_batched_tokens " \
           "8192" in printed
    assert "chunked prefill on against off: the short stream's longest stall" in printed
    assert "cannot differ" not in printed
    # The simulator is left as the bench found it; its switch takes that one setting only.
    sim = httpx.get(user.sim_url + "/version").json()["phasewatch_sim"]
    assert sim["enable_chunked_prefill"] is True and sim["max_num_batched_tokens"] == 8192
    refused = httpx.post(user.sim_url + "/sim/config", json={"max_num_seqs": 4})
    assert refused.status_code == 400 and "enable_chunked_prefill" in refused.text

    printed, run = interference["8000"]
    stall = stalls(run)  # what the user saw: the same stall either way (~29 model ms, where a
    # few ms of this machine's scheduling jitter is 10%; the default prompt's differ 2-3x)
    assert abs(stall["on"] - stall["off"]) < 0.25 * max(stall["on"], stall["off"])
    assert "on and off cannot differ here: the 8000-token prompt fits in one step of " \
           "max_num_batched_tokens 8192" in printed
    assert "Pass --long-prompt-tokens above 8191" in printed


def test_goodput_is_one_per_request_definition_for_the_verdict_the_figure_and_the_plot(
    goodput: tuple[str, str, RunResult]
) -> None:
    printed, progress, run = goodput
    summary, points = run.run["summary"], sorted(run.points, key=lambda p: p["step"])
    for p in points:
        f = p["extra"]["figures"]
        # Goodput is the good requests per second; the verdict counts the same good requests.
        assert p["goodput_rps"] == pytest.approx(f["slo_requests_met"] / f["span_s"])
        assert f["slo_attainment"] == pytest.approx(f["slo_requests_met"] / p["requests"])
        assert p["extra"]["slo_met"] is (f["slo_attainment"] >= 0.9 and p["errors"] == 0)
    met = [p for p in points if p["extra"]["slo_met"]]
    missed = [p for p in points if not p["extra"]["slo_met"]]
    assert met and missed  # the search found both sides of the limit
    best = max(met, key=lambda p: p["x_value"])
    assert summary["best_rate"] == best["x_value"] and summary["goodput_rps"] == best["goodput_rps"]
    assert all(p["x_value"] > best["x_value"] for p in missed)
    assert (f"highest rate with 90% of requests good (TTFT <= 100 ms and TPOT <= 5.0 ms each): "
            f"{best['x_value']:g} req/s, goodput there {best['goodput_rps']:.2f} req/s") in printed
    higher = [p for p in missed if p["goodput_rps"] > best["goodput_rps"]]
    assert bool(higher) == ("served more good requests per second" in printed)

    # The progress counter ends on the total it shows last, and never promised fewer steps.
    counted = [re.match(r"\[(\d+)/(at most )?(\d+)\] rate ", line)
               for line in progress.splitlines() if line.startswith("[")]
    assert all(counted) and len(counted) == len(points)
    for index, found in enumerate(counted, 1):
        assert found is not None and int(found[1]) == index
        assert int(found[3]) >= len(points) if found[2] else int(found[3]) == len(points)
    assert counted[-1] is not None and counted[-1][0] == f"[{len(points)}/{len(points)}] rate "

    # The plot: goodput on its own axes, in its own colour, line and marker.
    fig = draw(run.run, run.points)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert len(fig.axes) == 4  # no goodput squeezed onto a twin of the throughput axes
    lines = {line.get_label(): line for line in
             axes["completed and good requests per second"].get_lines()}
    good = next(line for label, line in lines.items() if label.startswith("goodput"))
    done = lines["completed req/s"]
    assert good.get_color() != done.get_color()
    assert (good.get_linestyle(), good.get_marker()) != (done.get_linestyle(), done.get_marker())
    assert not any(str(line.get_label()).startswith("goodput")
                   for line in axes["token throughput"].get_lines())


def test_errors_say_what_happened_and_reading_never_creates_a_database(
    user: User, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = user.run("bench", "prompt", "--url", url, "--no-store", "--out", str(tmp_path))
    assert done.returncode == 1
    assert f"connection refused at {url}: nothing is listening there" in done.stderr
    assert "--url" in done.stderr and "Traceback" not in done.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for args in (("runs", "list"), ("runs", "show", "prompt-")):
        done = user.run(*args, cwd=elsewhere)
        assert done.returncode == 1, done.stdout
        assert f"no database at {elsewhere / 'phasewatch.db'}" in done.stderr
        assert "nothing was created" in done.stderr and "--database-url" in done.stderr
    assert list(elsewhere.iterdir()) == []  # reading created nothing


def test_runs_can_be_told_apart_and_every_option_states_its_default(
    user: User, interference: dict[str, tuple[str, RunResult]]
) -> None:
    a, b = (interference[k][1].run["id"] for k in ("default", "8000"))
    listed = user.run("runs", "list", "--database-url", user.database_url)
    assert listed.returncode == 0
    assert listed.stdout.startswith(f"runs in {user.home / 'runs.db'}, newest first")
    by_id = {line.split()[0]: line for line in listed.stdout.splitlines()[2:]}
    assert "stall, default prompt" in by_id[a] and "stall, 8000 tokens" in by_id[b]

    compared = user.run("runs", "compare", a, b, "--database-url", user.database_url).stdout
    assert "long_prompt_tokens: 32764 -> 8000" in compared
    rows = compared.splitlines()
    for phase in ("before", "during", "after"):
        for setting in ("on", "off"):
            assert any(r.startswith(f"{phase}, chunked prefill {setting} ") for r in rows)
    assert not re.search(r"phase [0-5] ", compared)
    stall = next(line for line in compared.splitlines()
                 if line.startswith("during, chunked prefill off") and "ITL max" in line)
    assert float(stall.split("|")[1].split()[-1]) < 0.5  # B / A: 8000 tokens stall far less

    shown = user.run("bench", "interference", "--help").stdout
    assert re.search(r"--after-s AFTER_S\s+seconds it goes on after the long prompt's first "
                     r"token\s+\(default\s+0\.5\)", shown)
    assert re.search(r"--limit LIMIT\s+how many runs \(default 20\)",
                     user.run("runs", "list", "--help").stdout)
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    missing = []
    for command in ("bench", "runs"):
        for name, sub in commands[command]._subparsers._group_actions[0].choices.items():
            for action in sub._actions:
                if action.option_strings and action.dest != "help" and (
                        "default" not in (action.help or "")):
                    missing.append(f"{command} {name} {action.option_strings[0]}")
    assert missing == []


def test_plots_say_which_axis_is_log_and_draw_the_prompt_sweep_on_a_linear_one(
    user: User, interference: dict[str, tuple[str, RunResult]]
) -> None:
    _, _, prompt = user.bench("prompt", "--prompt-tokens", "64", "1024", "4096",
                              "--max-tokens", "8", "--requests", "1", "--quiet")
    run_id = prompt.run["id"]
    assert (user.home / "out" / f"{run_id}.png").stat().st_size > 10_000
    fig = draw(prompt.run, prompt.points)
    for ax in fig.axes:  # TTFT is linear in the prompt: a straight line on linear axes
        assert (ax.get_xscale(), ax.get_xlabel()) == ("linear", "prompt tokens")
    fig = draw(prompt.run, prompt.points, "log")
    assert all(ax.get_xlabel() == "prompt tokens (log scale)" for ax in fig.axes)
    both = interference["default"][1]
    timeline = draw(both.run, both.points)
    assert len(timeline.axes) == 2  # one panel per chunked-prefill setting
    for ax in timeline.axes:
        assert ax.get_yscale() == "log" and "(log scale)" in ax.get_ylabel()

    drawn = user.run("runs", "show", run_id[:-1], "--plots", str(user.home / "log"),
                     "--x-scale", "log", "--database-url", user.database_url)
    assert drawn.returncode == 0 and (user.home / "log" / f"{run_id}.png").is_file()


def test_the_readme_shows_an_interference_report_of_this_version(
    interference: dict[str, tuple[str, RunResult]]
) -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Benchmarks of a deployment")[1].split("\n## ")[0]

    def words(line: str) -> str:
        return " ".join(line.split())

    shown = {words(line) for line in section.splitlines()}
    printed = interference["default"][0].splitlines()
    header = next(i for i, line in enumerate(printed) if line.strip().startswith("short client"))
    for line in printed[header:header + 2]:  # the table's two header lines, as printed now
        assert words(line) in shown
    for start in ("long prompt: ", "chunked prefill on against off: "):
        assert any(line.startswith(start) for line in section.splitlines()), start

