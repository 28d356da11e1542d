"""`python -m phasewatch.sim [flags]`: the simulator without the phasewatch CLI (tests use it)."""

from phasewatch.sim.cli import main

raise SystemExit(main())
