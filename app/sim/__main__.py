"""`python -m app.sim [flags]`: run the simulator without the phasewatch CLI (tests use this)."""

from app.sim.cli import main

raise SystemExit(main())
