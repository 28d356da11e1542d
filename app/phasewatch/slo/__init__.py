"""SLOs as configuration: TTFT and ITL objectives rendered into Prometheus rules.

`spec` reads and validates the SLO file's contents, `rules` turns them into recording and
alerting rule groups (pure functions, no I/O), `files` does the YAML reading and writing, and
`cli` is the `phasewatch slo` command over them.
"""
