"""The fault suite: what an operator can do to phasewatch, or what can go wrong around it, each
tried against real servers on loopback, with what must hold.

| fault                                                 | test module                  |
|-------------------------------------------------------|------------------------------|
| SIGTERM with long streams in flight; a second signal  | test_shutdown                |
| upstream process SIGKILLed mid-stream                 | test_upstream_killed         |
| upstream drops, errors in-band, goes silent, is down  | test_endings                 |
| client leaves, stops reading, closes right after DONE | test_endings                 |
| Postgres stopped 20 s under load; SQLite file locked  | test_database_outage         |
| records cannot be stored (readiness)                  | test_readiness               |
| database failing or a NUL in a parameter (API)        | test_api_errors              |
| admin API, docs and run ids from an unauthorised one  | test_admin_access            |
| oversized or endless request bodies; hostile names    | test_limits                  |
| hostile model names in /metrics; a scrape storm       | test_metrics_bounds          |
| diagnosis labels: 404'd names, too many, gone quiet   | test_diagnosis_labels        |
| wide /api/stats windows over a million rows           | test_admin_api_load          |
| open-file limit, a connection flood; query strings    | test_serve_process           |
| encoded paths; `OPTIONS *`                            | test_passthrough_paths       |
| an OpenTelemetry collector that never answers         | test_otel_collector          |

Every wait is on a condition; the only timed waits are a scenario's own length (an outage's
20 s), never a guess at how long something takes.
"""
