"""`phasewatch slo render`, `check` and `init`: the argparse shell over `phasewatch.slo.files`.

`init` writes phasewatch's default SLO file (shipped in the package, the same as the
repository's deploy/slo.yaml) where `--file` says, so an installed phasewatch has one to edit.

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
    init = actions.add_parser(
        "init", help="write phasewatch's default SLO file to --file, to edit and render"
    )
    for action in (render, check, init):
        action.add_argument("--file", type=Path, default=DEFAULT_SLO_FILE,
                            help=f"the SLO file (default {DEFAULT_SLO_FILE})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from phasewatch.slo.files import default_spec_text, load_spec, render_files, stale, write
    from phasewatch.slo.spec import SloError

    if args.action == "init":
        if args.file.exists():
            print(f"phasewatch slo: {args.file} exists; not overwritten", file=sys.stderr)
            return 2
        args.file.parent.mkdir(parents=True, exist_ok=True)
        args.file.write_text(default_spec_text())
        print(f"wrote {args.file}: edit it, then `phasewatch slo render --file {args.file}`")
        return 0
    if not args.file.exists():
        print(f"phasewatch slo: no SLO file at {args.file}: pass --file PATH, or write "
              f"phasewatch's default there first (`phasewatch slo init --file {args.file}`)",
              file=sys.stderr)
        return 2
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
