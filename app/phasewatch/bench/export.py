"""Files a run leaves behind: its JSON export and, beside it, its plot (`<run id>.json/.png`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from phasewatch.bench.plots import PlotsUnavailable, write_plots
from phasewatch.bench.result import RunResult, to_json


@dataclass(slots=True)
class Written:
    json: Path | None = None
    plots: list[Path] = field(default_factory=list)
    note: str | None = None  # why plots were skipped, if they were

    def lines(self) -> list[str]:
        out = [f"exported {self.json}"] if self.json else []
        out += [f"plot {path}" for path in self.plots]
        return out + ([self.note] if self.note else [])


def export_run(result: RunResult, folder: Path, plots: bool = True,
               x_scale: str | None = None) -> Written:
    folder.mkdir(parents=True, exist_ok=True)
    written = Written(json=folder / f"{result.run['id']}.json")
    assert written.json is not None
    written.json.write_bytes(to_json(result))
    if plots and result.points:
        try:
            written.plots = write_plots(result.run, result.points, folder, x_scale)
        except PlotsUnavailable as exc:
            written.note = str(exc)
    return written
