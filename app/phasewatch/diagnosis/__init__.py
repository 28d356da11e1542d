"""Diagnosis: which phase is broken, from the proxy's own records (and the engine's, if any).

The core is pure: observations in, findings out, with no web framework, database, HTTP client
or clock. `observations` (the input types), `statistics` (rank tests, bootstrap, correlation),
`compare` (one material-and-significant comparison), `prompt_adjust` (TTFT at equal prompt
length and decode pace), `stalls` (mid-stream stalls against long prefills), `verdicts` (the
eight verdicts and the article's actions) and `diagnose` (the rules) are that core, and
tests/diagnosis/test_purity.py holds them to it.

Two modules are the shell around it: `service` reads the store (requests, engine scrapes), runs
the core off the event loop, keeps the verdict history and the schedule; `metrics` holds the
Prometheus gauges. Method, statistics and limits: docs/diagnosis.md.
"""
