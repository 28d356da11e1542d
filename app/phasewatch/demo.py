"""`phasewatch demo` and `phasewatch up`: the simulator and the proxy on loopback, together.

Both start two child processes (the simulator, then the proxy in front of it), each with its
own interpreter and event loop so neither's Python overhead lands in the other's timings.
`up` prints the URLs and serves until Ctrl-C; `demo` runs the article's two experiments
through the proxy (`phasewatch.bench.article`), prints them next to the article's tables and
phasewatch's own stored view, and stops both servers. Settings for the proxy come from the
usual `PHASEWATCH_*` variables (SQLite in ./phasewatch.db unless told otherwise).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from phasewatch.bench.article import DemoOptions, run_article
from phasewatch.core.settings import SettingsError, load_settings


class StackError(RuntimeError):
    """A child server did not come up; the message carries the tail of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class StackOptions:
    gpu: str = "t4"
    model: str = "qwen2.5-0.5b"
    time_scale: float = 1.0
    sim_port: int = 0  # 0: a free port
    proxy_port: int = 0
    sim_args: tuple[str, ...] = ()  # further `phasewatch sim` flags
    database_url: str | None = None  # the proxy's records; None: PHASEWATCH_DATABASE_URL
    quiet: bool = True  # children's logs to a file (shown if they fail) instead of the terminal


@dataclass(frozen=True, slots=True)
class Stack:
    sim_url: str
    proxy_url: str
    database_url: str


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
    state = f"exited with {proc.returncode}" if proc.poll() is not None else "did not answer"
    raise StackError(f"{url} {state} within {timeout:g} s\n{tail}".rstrip())


@contextmanager
def _child(args: Sequence[str], log: Path | None,
           env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A child interpreter running `args`, stopped gracefully on exit (not waited for here)."""
    out: IO[bytes] | None = log.open("wb") if log is not None else None
    proc = subprocess.Popen(
        [sys.executable, *args], stdout=out, stderr=subprocess.STDOUT if out else None,
        env={**os.environ, **(env or {})},
        # Its own session: a Ctrl-C at the terminal reaches only us, and we stop the child
        # with one SIGINT (a second would make uvicorn skip its graceful shutdown).
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown: the writer flushes
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if out is not None:
            out.close()


@contextmanager
def running_stack(options: StackOptions) -> Iterator[Stack]:
    """Start the simulator and the proxy in front of it; stop both on exit.

    Both start at once (the proxy needs its upstream only when a request comes), then each is
    waited for; the proxy stops first, so it can flush its records.
    """
    # Fail early, before starting anything.
    database_url = options.database_url or load_settings().database_url
    sim_port = options.sim_port or free_port()
    proxy_port = options.proxy_port or free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="phasewatch-")))
        sim_args = [
            "-m", "phasewatch.sim", "--port", str(sim_port), "--gpu", options.gpu,
            "--model", options.model, "--time-scale", f"{options.time_scale:g}",
            *options.sim_args,
        ]
        if options.quiet:
            sim_args += ["--log-level", "warning"]
        sim_log = logs / "sim.log" if options.quiet else None
        proxy_log = logs / "proxy.log" if options.quiet else None
        sim = stack.enter_context(_child(sim_args, sim_log))
        # A sandbox on this machine's loopback only: its admin API (records, stats, run ids)
        # is open to the bench in this process and to the user, unless a token is set.
        proxy_env = {"PHASEWATCH_DATABASE_URL": database_url, "PHASEWATCH_HOST": "127.0.0.1",
                     "PHASEWATCH_ADMIN_OPEN": "true"}
        if options.quiet:
            proxy_env["PHASEWATCH_LOG_LEVEL"] = "warning"
        proxy = stack.enter_context(_child(
            ["-m", "phasewatch.cli", "serve", "--upstream", sim_url, "--port", str(proxy_port)],
            proxy_log, proxy_env,
        ))
        _wait_http(sim_url + "/health", sim, sim_log, timeout=60.0)
        _wait_http(proxy_url + "/api/health", proxy, proxy_log, timeout=60.0)
        yield Stack(sim_url, proxy_url, database_url)


def run_demo(stack_options: StackOptions, demo_options: DemoOptions) -> int:
    """Start everything, run the article's experiments through the proxy, print, stop."""
    try:
        with running_stack(stack_options) as stack:
            print(f"simulator {stack.sim_url}  proxy {stack.proxy_url}  "
                  f"records in {stack.database_url}", flush=True)
            report = asyncio.run(run_article(stack.proxy_url, stack.sim_url, demo_options))
    except (StackError, SettingsError) as exc:
        print(f"phasewatch demo: {exc}", file=sys.stderr)
        return 1
    print(report, flush=True)
    return 0


def run_up(options: StackOptions) -> int:
    """Serve the simulator and the proxy until Ctrl-C."""
    try:
        with running_stack(options) as stack:
            print(
                f"simulator   {stack.sim_url}  ({options.gpu} + {options.model}, "
                f"time-scale {options.time_scale:g})\n"
                f"proxy       {stack.proxy_url}/v1   (point an OpenAI client here)\n"
                f"metrics     {stack.proxy_url}/metrics\n"
                f"stats       {stack.proxy_url}/api/stats?window=5m&by=model\n"
                f"requests    {stack.proxy_url}/api/requests\n"
                "admin API   open to this machine only (a deployment keeps it closed: README)\n"
                f"records in  {stack.database_url}\n"
                "Ctrl-C stops both.",
                flush=True,
            )
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                print("\nstopping", flush=True)
    except (StackError, SettingsError) as exc:
        print(f"phasewatch up: {exc}", file=sys.stderr)
        return 1
    return 0
