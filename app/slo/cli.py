"""`phasewatch slo render` and `phasewatch slo check`: the argparse shell over `app.slo.files`.

Exit codes: 0 done; 1 the generated files are stale (`check`); 2 the SLO file is invalid,
with the reason on stderr (a threshold that is not a bucket edge, an objective too low for
the page to ever fire, a typo in a key).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Relative to where the command runs: the repository root, as `make slo` runs it.
DEFAULT_SLO_FILE = Path("deploy/slo.yaml")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `slo` on a parent parser's subcommands; `args.func(args)` runs it."""
    parser = subparsers.add_parser(
        "slo", help="render the TTFT/ITL SLO file into Prometheus rules, or check them",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    render = actions.add_parser(
        "render", help="write the recording and alerting rules next to the SLO file"
    )
    check = actions.add_parser(
        "check", help="validate the SLO file; fail if the rendered rules are not up to date"
    )
    for action in (render, check):
        action.add_argument("--file", type=Path, default=DEFAULT_SLO_FILE,
                            help=f"the SLO file (default {DEFAULT_SLO_FILE})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from app.slo.files import load_spec, render_files, stale, write
    from app.slo.spec import SloError

    try:
        spec = load_spec(args.file)
    except SloError as exc:
        print(f"phasewatch slo: {exc}", file=sys.stderr)
        return 2
    files = render_files(spec, args.file)
    if args.action == "render":
        write(files)
        for file in files:
            print(f"wrote {file.path}")
        return 0
    outdated = stale(files)
    if outdated:
        names = ", ".join(str(path) for path in outdated)
        print(f"phasewatch slo: {names} not up to date with {args.file}: run "
              "`phasewatch slo render` (or `make slo`)", file=sys.stderr)
        return 1
    print(f"{args.file}: valid; {', '.join(str(f.path) for f in files)} up to date")
    return 0
