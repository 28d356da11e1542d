"""The README's copy-paste setups, as the tests that run them read them.

`blocks("OpenTelemetry (OTLP)", "sh")` is every fenced ```sh block under that heading (up to
the next heading of the same or a higher level), so a test runs exactly what a reader copies.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def section(title: str) -> str:
    """The text under the heading whose title is `title` (any level)."""
    lines = README.read_text().splitlines(keepends=True)
    headings: list[tuple[int, int, str]] = []  # (line, level, title), outside code blocks
    fenced = False
    for number, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"(#+) (.*)$", line.rstrip("\n"))):
            headings.append((number, len(match.group(1)), match.group(2)))
    for index, (start, level, found) in enumerate(headings):
        if found == title:
            end = next((line for line, deeper, _ in headings[index + 1:] if deeper <= level),
                       len(lines))
            return "".join(lines[start + 1:end])
    raise AssertionError(f"README.md has no heading {title!r}")


def blocks(title: str, language: str) -> list[str]:
    """The fenced code blocks in `language` under the heading `title`, in order."""
    found = [body for lang, body in _FENCE.findall(section(title)) if lang == language]
    assert found, f"README.md, {title!r}: no ```{language} block"
    return found
