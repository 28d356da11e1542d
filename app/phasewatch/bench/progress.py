"""Progress of a sweep on stderr: a rich progress bar when `rich` is installed (the `bench`
extra) and stderr is a terminal, else one plain line per finished step. Never on stdout, which
carries the report.

A total is exact unless it is given `at_most`: a search that can stop early (goodput) shows
"[3/at most 7]" and revises the total as it learns, so the count it ends on is the total it
shows last ("[6/6]"), never a promise it did not keep."""

from __future__ import annotations

import sys
from typing import Any, Protocol


class Progress(Protocol):
    def start(self, total: int | None, description: str, at_most: bool = False) -> None: ...
    def revise(self, total: int, at_most: bool) -> None: ...
    def advance(self, label: str) -> None: ...
    def stop(self) -> None: ...


class NoProgress:
    def start(self, total: int | None, description: str, at_most: bool = False) -> None:
        pass

    def revise(self, total: int, at_most: bool) -> None:
        pass

    def advance(self, label: str) -> None:
        pass

    def stop(self) -> None:
        pass


class LineProgress:
    """`[3/12] concurrency 16, repeat 2` per step: readable in logs and CI."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.at_most = False
        self.done = 0

    def start(self, total: int | None, description: str, at_most: bool = False) -> None:
        self.total, self.at_most, self.done = total, at_most, 0
        print(description, file=sys.stderr, flush=True)

    def revise(self, total: int, at_most: bool) -> None:
        self.total, self.at_most = total, at_most

    def advance(self, label: str) -> None:
        self.done += 1
        of = f"/{'at most ' if self.at_most else ''}{self.total}" if self.total else ""
        print(f"[{self.done}{of}] {label}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        pass


class RichProgress:
    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as Bar

        self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[label]}"),
                        console=Console(stderr=True), transient=False)
        self._task: Any = None
        self._description = ""

    def _named(self, at_most: bool) -> str:
        return self._description + (" (the total is at most)" if at_most else "")

    def start(self, total: int | None, description: str, at_most: bool = False) -> None:
        self._description = description
        self._bar.start()
        self._task = self._bar.add_task(self._named(at_most), total=total, label="")

    def revise(self, total: int, at_most: bool) -> None:
        self._bar.update(self._task, total=total, description=self._named(at_most))

    def advance(self, label: str) -> None:
        self._bar.update(self._task, advance=1, label=label)

    def stop(self) -> None:
        self._bar.stop()


def make_progress(enabled: bool = True) -> Progress:
    if not enabled:
        return NoProgress()
    if sys.stderr.isatty():
        try:
            return RichProgress()
        except ImportError:
            pass
    return LineProgress()
