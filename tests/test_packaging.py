"""phasewatch as users install it: the built wheel and sdist, installed the way the image
installs them (deploy/install-runtime.sh: the locked dependencies, then the wheel), run from a
directory with no source tree around; and the lock file agreeing with pyproject.toml.

The wheel test builds with `python -m build` and installs from PyPI, as a user's machine does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from phasewatch import __version__
from tests.support.servers import free_port, subprocess_server

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
IMAGE_EXTRAS = ("postgres", "otel")  # what the image installs beside the core (Dockerfile)


def locked() -> tuple[dict[str, str], set[str], list[str]]:
    """The lock's pins (name -> version), the names it says pyproject.toml asked for, and the
    pins that carry no hash."""
    pins: dict[str, str] = {}
    direct: set[str] = set()
    unhashed: list[str] = []
    current = ""
    for block in re.split(r"\n(?=[A-Za-z0-9])", LOCK.read_text()):
        first = block.split("\n", 1)[0]
        match = re.match(r"([A-Za-z0-9._-]+)==([^\s\\]+)", first)
        if not match:
            continue
        current = canonicalize_name(match.group(1))
        pins[current] = match.group(2)
        if "--hash=sha256:" not in block:
            unhashed.append(current)
        if "phasewatch (pyproject.toml)" in block:
            direct.add(current)
    return pins, direct, unhashed


def extra_requirements(name: str, extra: str) -> list[str]:
    """What `name[extra]` adds on Linux with this Python, from the installed distribution."""
    out = []
    for text in metadata.requires(name) or []:
        requirement = Requirement(text)
        if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}) \
                and not requirement.marker.evaluate({"extra": ""}):
            out.append(requirement.name)
    return out


def test_the_lock_pins_exactly_what_pyproject_asks_for() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    for extra in IMAGE_EXTRAS:
        wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
    pins, direct, unhashed = locked()
    assert {canonicalize_name(r.name) for r in wanted} == direct, "run `make lock`"
    for requirement in wanted:
        version = pins[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(version), (requirement, version)
        for extra in requirement.extras:  # uvicorn[standard], sqlalchemy[asyncio]
            for needed in extra_requirements(requirement.name, extra):
                assert canonicalize_name(needed) in pins, (requirement, needed)
    assert not unhashed, f"pins without hashes: {unhashed}"


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{command}: {done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)],
        ROOT, dict(os.environ), timeout=300)
    return out


def test_the_artefacts_hold_the_package_and_pass_twine(dist: Path) -> None:
    [wheel] = dist.glob("phasewatch-*.whl")
    [sdist] = dist.glob("phasewatch-*.tar.gz")
    # A platform wheel: the native leg (app/phasewatch/proxy/csrc/) is compiled into it.
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert re.fullmatch(rf"phasewatch-{re.escape(__version__)}-{tag}-{tag}-linux_\w+\.whl",
                        wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(r"phasewatch/proxy/_native\.[\w.-]+\.so", name) for name in names)
    with tarfile.open(sdist) as archive:  # the sdist builds it again
        sources = archive.getnames()
        for source in ("scan.c", "scan.h", "itl.c", "itl.h", "relay.c", "relay.h", "relay_py.c",
                       "relay_py.h", "module.c"):
            assert any(name.endswith(f"/app/phasewatch/proxy/csrc/{source}")
                       for name in sources), source
    top = {name.split("/", 1)[0] for name in names}
    assert top == {"phasewatch", f"phasewatch-{__version__}.dist-info"}  # no `app` package
    packages = {str(init.parent.relative_to(ROOT / "app")) for init in
                (ROOT / "app" / "phasewatch").rglob("__init__.py")}
    assert {f"{package}/__init__.py" for package in packages} <= set(names)
    for needed in ("phasewatch/migrations/env.py", "phasewatch/migrations/script.py.mako",
                   "phasewatch/migrations/versions/0001_initial_schema.py",
                   "phasewatch/slo/default_slo.yaml", "phasewatch/py.typed",
                   "phasewatch/proxy/_native.pyi",
                   f"phasewatch-{__version__}.dist-info/licenses/LICENSE"):
        assert needed in names, needed
    run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], dist,
        dict(os.environ))


def test_the_wheel_installs_as_the_image_does_and_runs_anywhere(
    dist: Path, tmp_path: Path
) -> None:
    [wheel] = dist.glob("phasewatch-*.whl")
    venv = tmp_path / "venv"
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PHASEWATCH_", "PYTHON", "VIRTUAL_ENV"))}
    run(["sh", str(ROOT / "deploy" / "install-runtime.sh"), str(venv), str(LOCK), str(wheel)],
        tmp_path, {**env, "PYTHON": sys.executable}, timeout=600)
    work = tmp_path / "elsewhere"  # no source tree, no migrations or deploy/ beside it
    work.mkdir()
    bin_ = venv / "bin"
    env = {**env, "PATH": f"{bin_}:{env['PATH']}",
           "PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{work / 'pw.db'}",
           # The admin API is closed by default: serve opens it to this token, bench sends it.
           "PHASEWATCH_ADMIN_TOKEN": "packaging-test-token"}
    assert run(["phasewatch", "--version"], work, env).strip() == f"phasewatch {__version__}"
    missing = subprocess.run([str(bin_ / "python"), "-c", "import app"], cwd=work, env=env,
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "No module named 'app'" in missing.stderr
    run(["phasewatch", "db", "upgrade"], work, env)
    assert "up to date" in run(["phasewatch", "db", "current"], work, env)
    run(["phasewatch", "slo", "init", "--file", "slo.yaml"], work, env)
    run(["phasewatch", "slo", "render", "--file", "slo.yaml"], work, env)
    assert (work / "rules" / "phasewatch-slo.rules.yml").exists()
    report = run(["phasewatch", "demo", "--quick"], work, env, timeout=180)
    assert "Experiment 2" in report
    # serve and bench, as separate commands against the simulator.
    sim_port, proxy_port = free_port(), free_port()
    sim = ["-m", "phasewatch.cli", "sim", "--port", str(sim_port), "--log-level", "warning"]
    serve = ["-m", "phasewatch.cli", "serve", "--upstream", f"http://127.0.0.1:{sim_port}",
             "--port", str(proxy_port)]
    with subprocess_server(sim, f"http://127.0.0.1:{sim_port}/health", env=env,
                           python=str(bin_ / "python"), cwd=work), \
            subprocess_server(serve, f"http://127.0.0.1:{proxy_port}/api/health", env=env,
                              python=str(bin_ / "python"), cwd=work):
        out = run(["phasewatch", "bench", "prompt", "--url", f"http://127.0.0.1:{proxy_port}",
                   "--prompt-tokens", "32", "128", "--max-tokens", "8", "--requests", "2",
                   "--no-plots", "--quiet", "--out", str(work / "bench")], work, env)
        # The installed wheel's native relay carried the middle of those streams.
        metrics = httpx.get(f"http://127.0.0.1:{proxy_port}/metrics").text
        native = re.search(r"^phasewatch_native_relay_streams_total (\S+)$", metrics, re.M)
        assert native is not None and float(native.group(1)) > 0, metrics
    assert list((work / "bench").glob("*.json")), out
