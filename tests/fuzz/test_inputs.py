"""The fuzz targets' inputs (tests/fuzz/corpus/, tests/fuzz/regressions/) through the extension
as the relay loads it: every crash input ever found stays a test, here and under the
sanitizers (`make test-sanitize` runs this file with ASan and UBSan; `make fuzz` runs the C
targets on them)."""

from __future__ import annotations

import struct
from array import array
from pathlib import Path

import pytest

from phasewatch.proxy import _native
from tests.support.itl_oracle import replay_py
from tests.support.sanitized import SANITIZED_NATIVE

HERE = Path(__file__).parent
BOUNDS = array("d", [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, float("inf")])


def _id(path: Path) -> str:
    return f"{path.parent.parent.name}/{path.name}"


def _inputs(target: str) -> list[Path]:
    found = [p for kind in ("corpus", "regressions") for p in (HERE / kind / target).glob("*")]
    return sorted(found)


def test_the_sanitized_build_is_the_one_loaded_when_asked() -> None:
    if not SANITIZED_NATIVE:
        pytest.skip("not under `make test-sanitize`")
    assert Path(_native.__file__).parent == Path(SANITIZED_NATIVE)


@pytest.mark.parametrize("path", _inputs("take"), ids=_id)
def test_take_inputs(path: Path) -> None:
    data = path.read_bytes()
    flags, body = data[0], data[2:]
    scanner = _native.Scanner(bool(flags & 1), bool(flags & 2), bool(flags & 4))
    pending, verdict = b"", _native.TAKE_ON
    for start in range(0, len(body), 97):
        pending += body[start:start + 97]
        verdict, used, _, events = scanner.take(pending, start)
        assert 0 <= used <= len(pending) and len(events) % 24 == 0
        pending = pending[used:]
        if verdict != _native.TAKE_ON:
            break
    # A whole stream of vLLM's is taken to its end, but for what the Python path must read: an
    # error, spaced JSON, the first events when pending, a terminal chunk held (`hold`) for a
    # usage chunk that does not come.
    plain = (path.parent.parent.name == "corpus" and not flags & 4 and b"error" not in body
             and not path.name.startswith("spaced")
             and not (flags & 2 and b'"choices":[]' not in body))
    if plain:
        assert verdict == _native.TAKE_ENDED


@pytest.mark.parametrize("path", _inputs("event"), ids=_id)
def test_event_inputs(path: Path) -> None:
    data = path.read_bytes()
    read = _native.token_event(data)
    if read is not None:
        completion, prompt, cut_from, cut_to = read
        assert 0 <= completion <= 1 << 24 and (prompt is None or prompt >= 0)
        assert 0 <= cut_from < cut_to <= len(data) and data[cut_to - 1:cut_to] == b"}"


@pytest.mark.parametrize("path", _inputs("replay"), ids=_id)
def test_replay_inputs_match_the_oracle(path: Path) -> None:
    data = path.read_bytes()
    seen, last = struct.unpack_from("<qq", data)
    events = array("q", data[16:16 + (len(data) - 16) // 24 * 24])
    args = (events, seen & 0xFFFFFF, last, 0.0, 0.0, BOUNDS, True)
    assert _native.replay_exact(*args) == replay_py(*args)
