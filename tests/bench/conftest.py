"""Two simulator + phasewatch stacks for the bench's end-to-end tests, started together.

Each stack is `phasewatch.demo.running_stack`: the simulator and the proxy, each in its own process
on a free loopback port (so the bench client, which runs in the test process, shares no GIL with
them). Both proxies and every bench run share one SQLite file, as a bench through a local
phasewatch shares the proxy's store by default.

- "article": T4 + Qwen2.5-0.5B (the article's setup), chunked prefill off so a long prompt
  stalls other streams, max_model_len 8192 for an 8000-token prompt; time-scale 2 keeps the
  Python per-chunk costs of proxy and client small against the model's ~10 ms steps.
- "capped": two sequences at most (`--max-num-seqs 2`), so queueing sets in at a rate a test
  can reach in a few seconds, and half the preset's MFU (prefill twice as slow, decode the
  same, so `runs compare` against the first stack has a real change to find); time-scale 0.5
  (the model runs twice as fast as real time) keeps the rate tests short.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from phasewatch.bench.result import RunResult, from_json
from phasewatch.bench.storage import RunStore
from phasewatch.cli import main
from phasewatch.demo import Stack, StackOptions, running_stack

STACKS = {
    "article": StackOptions(time_scale=2.0, sim_args=(
        "--max-model-len", "8192", "--no-enable-chunked-prefill")),
    "capped": StackOptions(time_scale=0.5, sim_args=("--max-num-seqs", "2", "--mfu", "0.11")),
}


@dataclass(frozen=True)
class Bench:
    """Runs `phasewatch bench`/`runs` in this process, against the shared store."""

    database_url: str
    out: Path
    stacks: dict[str, Stack]

    def run(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
        """Exit code, stdout and stderr of `phasewatch ARGS --database-url <the store>`."""
        capsys.readouterr()
        code = main([*args, "--database-url", self.database_url])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    def bench(self, capsys: pytest.CaptureFixture[str], stack: str, mode: str,
              *args: str) -> tuple[str, RunResult]:
        """Run one bench mode through a stack's proxy; the printed report and the export."""
        code, out, _ = self.run(capsys, "bench", mode, "--url", self.stacks[stack].proxy_url,
                             "--out", str(self.out), "--quiet", *args)
        assert code == 0, out
        run_id = out.split("phasewatch runs show ")[-1].strip()
        return out, from_json((self.out / f"{run_id}.json").read_bytes())

    def stored(self, run_id: str) -> RunResult:
        async def load() -> RunResult:
            async with RunStore(self.database_url) as store:
                return await store.load(run_id)

        return asyncio.run(load())


async def _migrate(database_url: str) -> None:
    async with RunStore(database_url):
        pass


@pytest.fixture(scope="package")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    root = tmp_path_factory.mktemp("bench")
    database_url = f"sqlite+aiosqlite:///{root / 'phasewatch.db'}"
    asyncio.run(_migrate(database_url))  # once, before two proxies would race to do it
    managers: dict[str, AbstractContextManager[Stack]] = {
        name: running_stack(replace(options, database_url=database_url))
        for name, options in STACKS.items()
    }
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = {name: pool.submit(cm.__enter__) for name, cm in managers.items()}
        stacks: dict[str, Stack] = {}
        errors: list[Exception] = []
        for name, future in futures.items():
            try:
                stacks[name] = future.result()
            except Exception as exc:  # stop whatever did start, then fail
                errors.append(exc)
    try:
        if errors:
            raise errors[0]
        yield Bench(database_url, root / "out", stacks)
    finally:
        for name in stacks:
            managers[name].__exit__(None, None, None)
