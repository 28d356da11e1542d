"""Settings for the proxy, read from `PHASEWATCH_*` environment variables.

One `Settings` object is built at startup and passed explicitly; nothing reads the
environment anywhere else. A bad value fails at startup with a sentence naming the variable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import AnyHttpUrl, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "PHASEWATCH_"
LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class SettingsError(ValueError):
    """Raised when the configuration is invalid; its message is meant for a human."""


class Settings(BaseSettings):
    """Every setting, one `PHASEWATCH_<NAME>` variable each. Each field's docstring is its
    description in docs/configuration.md (generated: `make configuration`)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True,
                                      populate_by_name=True, use_attribute_docstrings=True)

    # Listening and upstream.
    upstream_url: AnyHttpUrl = Field(default=AnyHttpUrl("http://127.0.0.1:8000"))
    """The OpenAI-compatible engine (vLLM) phasewatch relays to."""
    host: str = "127.0.0.1"
    """The address the proxy listens on."""
    port: int = Field(default=8080, ge=1, le=65535)
    """The port the proxy listens on."""
    workers: int = Field(default=1, ge=1, le=256)
    """Processes serving that one port (`phasewatch serve --workers N`). A worker buys a core,
    not efficiency: add workers when one core no longer keeps up (docs/operations.md, "How to
    scale")."""
    metrics_dir: Path | None = Field(default=None, validation_alias="PROMETHEUS_MULTIPROC_DIR")
    """With more than one worker, where each keeps its metrics for `/metrics` to merge (emptied
    at startup; `phasewatch serve` makes a temporary directory when unset). Set it to choose
    the place, say a tmpfs. Read from `PROMETHEUS_MULTIPROC_DIR`, prometheus_client's own
    variable."""
    upstream_connect_timeout_s: float = Field(default=10.0, gt=0)
    """Connecting to the upstream."""
    upstream_idle_timeout_s: float = Field(default=600.0, gt=0)
    """The longest silence between two reads from the upstream, the wait for a response's head
    included (checked every min(1 s, timeout / 4)). There is no total timeout: long queue waits
    and prefills are never cut."""
    upstream_max_connections: int = Field(default=0, ge=0)
    """Open upstream connections at most, for the timed relay and separately for the
    pass-through; a request over the cap waits for one. 0: no cap."""
    upstream_continuous_usage: bool = True
    """Ask the upstream for per-chunk usage (`continuous_usage_stats`, a vLLM extension) so
    every token count is exact; turn off for upstreams that reject the field."""
    native_relay: bool = True
    """Relay the body of an exactly counted stream in the native relay's thread (Linux);
    `false`: every read goes through Python."""

    # Clients.
    client_head_timeout_s: float = Field(default=30.0, gt=0)
    """A request's head must arrive within this long of its first byte (a new connection's
    first, of the connection's start), or the client gets `408` (`request_timeout`) and the
    connection is closed."""
    client_stall_timeout_s: float = Field(default=60.0, gt=0)
    """A client that reads nothing of its stream for this long (its socket buffers full) is cut
    off and its upstream request closed, so it does not hold an engine slot."""
    max_client_connections: int = Field(default=0, ge=0)
    """Client connections a worker holds at once; past it a new one gets `503` at once. 0:
    (open-file limit - 64) / 4 with the native relay, / 2 without (`phasewatch serve` raises
    the soft limit to the hard one)."""
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """The largest request body accepted; a larger one gets `413` (`invalid_request_error`)
    and the connection is closed without reading the rest."""

    # Metrics.
    slo_ttft_s: float = Field(default=0.5, gt=0)
    """The TTFT objective; an exact bucket edge of the TTFT histogram."""
    slo_itl_s: float = Field(default=0.04, gt=0)
    """The ITL objective; an exact bucket edge of the ITL histogram."""
    stall_threshold_s: float = Field(default=5.0, gt=0)
    """A decoding stream silent for longer than this counts on `phasewatch_streams_stalled`."""
    max_model_labels: int = Field(default=32, ge=1)
    """Model names with their own metric label; the rest share `other`."""
    metrics_cache_s: float = Field(default=1.0, ge=0)
    """A `/metrics` render (made in a worker thread, one at a time) is reused for this long, so
    any number of scrapers costs at most one render per interval. 0: render every scrape."""
    exemplars: bool = True
    """TTFT and ITL buckets carry a request's id as an OpenMetrics exemplar (one worker only:
    under several, prometheus_client keeps none)."""
    otel_enabled: bool = False
    """Export the OpenTelemetry GenAI metrics and a span per request over OTLP/HTTP, configured
    by the standard `OTEL_*` variables (needs the `otel` extra). Off: no OpenTelemetry code
    runs."""
    otel_provider_name: str = Field(default="vllm", min_length=1, max_length=64)
    """`gen_ai.provider.name` on what is exported: the engine behind the proxy."""

    # Operations.
    shutdown_grace_s: float = Field(default=60.0, ge=0)
    """On SIGTERM, how long open streams may run before they are ended with an in-band error.
    Keep it below the orchestrator's kill deadline less `shutdown_flush_s` and a few seconds."""
    shutdown_flush_s: float = Field(default=10.0, gt=0)
    """Then, how long the queued records may take to be stored."""
    ready_writer_failing_s: float = Field(default=30.0, gt=0)
    """`/api/ready` fails once records have failed to store for this long."""
    admin_token: SecretStr | None = None
    """Opens the admin surface (`/api`, the API docs, the run-id header) to callers that send
    it as `x-phasewatch-admin-token`. Unset, with `admin_open` false: closed."""
    admin_open: bool = False
    """Opens the admin surface to every caller (a trusted network)."""
    access_log: bool = False
    """uvicorn's access log, one line per request. It holds each request's path and query
    string, which clients may treat as private."""
    log_level: LogLevel = "info"
    """`debug`, `info`, `warning`, `error` or `critical`."""
    leader_check_interval_s: float = Field(default=5.0, gt=0)
    """Retention, the engine scrape and the diagnosis schedule run in one process per database:
    how often the others try to take them over, and the leader checks it still holds them."""

    # The admin API (it shares the relay's event loop).
    api_max_window_s: float = Field(default=7 * 86400.0, gt=0)
    """The widest window `/api/stats` answers; a wider one gets `422`."""
    api_max_rows: int = Field(default=20_000, ge=100)
    """The most rows `/api/stats` ranks for its percentiles; a window holding more is ranked
    from a uniform sample of this many (totals stay exact)."""
    api_timeout_s: float = Field(default=10.0, gt=0)
    """Any `/api` call still running after this long is stopped, its database query with it,
    and answered `503` (`query_timeout`)."""

    # Storage.
    database_url: str = "sqlite+aiosqlite:///phasewatch.db"
    """Where records and runs are stored: an SQLite file (created on first start, WAL mode) or
    `postgresql+asyncpg://user@host:5432/db`."""
    database_auto_upgrade: bool = False
    """Apply pending migrations at startup instead of refusing to start on an old schema."""
    record_queue_size: int = Field(default=10_000, ge=1)
    """Finished-request records waiting to be stored; beyond it they are dropped and
    counted."""
    writer_batch_size: int = Field(default=100, ge=1)
    """Records per insert at most."""
    writer_flush_interval_s: float = Field(default=1.0, gt=0)
    """The longest a record waits for its batch: a finished request is in the database within
    about this long."""
    retention_days: float = Field(default=14.0, ge=0)
    """Raw request rows older than this are deleted (per-minute rollups stay). 0: kept
    forever."""
    retention_interval_s: float = Field(default=300.0, gt=0)
    """How often retention runs."""

    # Diagnosis (docs/diagnosis.md).
    diagnosis_interval_s: float = Field(default=10.0, ge=0)
    """How often the schedule judges every active model. 0: no schedule (the API still
    answers)."""
    diagnosis_window_s: float = Field(default=300.0, gt=0)
    """The schedule's window."""
    diagnosis_baseline_s: float = Field(default=3600.0, gt=0)
    """The baseline before the window (also the API's default)."""
    diagnosis_recent_s: float = Field(default=60.0, gt=0)
    """The schedule judges this last part of the window when it holds enough requests, the
    whole window otherwise."""
    diagnosis_hold_rounds: int = Field(default=2, ge=1)
    """Rounds in a row a new verdict needs before the schedule reports it."""
    diagnosis_switch_confidence: float = Field(default=0.95, gt=0, le=1)
    """... unless its confidence is at least this (only from `healthy` or `insufficient_data`
    to an incident)."""
    diagnosis_min_samples: int = Field(default=20, ge=5)
    """Timed requests each side needs before anything is judged."""
    diagnosis_max_samples: int = Field(default=3000, ge=100)
    """Requests read per span at most; a larger span is evenly thinned (rates use the full
    count)."""
    diagnosis_live_max_age_s: float = Field(default=10.0, gt=0)
    """A process's live snapshot (its requests in flight) counts when taken at most this long
    before the window's end."""
    live_snapshot_interval_s: float = Field(default=5.0, ge=0)
    """How often every process publishes its requests in flight: half the schedule's interval,
    so each round reads a snapshot at most that old. 0: never."""
    live_snapshot_max_requests: int = Field(default=1000, ge=1)
    """Requests per published snapshot at most (the oldest kept)."""
    engine_metrics_url: AnyHttpUrl | None = None
    """The engine's Prometheus endpoint, read to corroborate a diagnosis. Unset: the
    upstream's `/metrics`."""
    engine_metrics_enabled: bool = True
    """`false`: the engine is not scraped; the diagnosis works from the records alone."""
    engine_scrape_interval_s: float = Field(default=15.0, gt=0)
    """How often the engine is scraped; also right before each scheduled round, so a round
    reads the engine's queue as it is then."""
    engine_scrape_timeout_s: float = Field(default=5.0, gt=0)
    """A scrape of the engine's metrics that takes longer fails (counted, logged once per
    outage)."""

    # Capacity (docs/plan.md).
    capacity_interval_s: float = Field(default=0.0, ge=0)
    """How often the leader reads each active model's request rate and exports its SLO
    headroom (`phasewatch_slo_headroom`, docs/plan.md) on its latest calibration, and starts
    the next calibration if the last has finished (in a worker process of its own: tens of
    seconds of one core per model). 0 (the default): never; 300 is a reasonable value, 30 for
    an autoscaler."""
    capacity_window_s: float = Field(default=3600.0, gt=0)
    """The span of stored requests the headroom is calibrated on."""
    capacity_rate_window_s: float = Field(default=60.0, gt=0)
    """The span the current request rate is read over, for the headroom (arrivals, those still
    in flight included): short enough to follow a ramp, long enough to average out arrivals."""
    capacity_max_requests: int = Field(default=3000, ge=100)
    """Requests of that span read at most (the latest)."""
    capacity_engine_replicas: int = Field(default=1, ge=1)
    """Engine replicas behind the upstream URL, sharing the model's traffic: the headroom is
    their highest rate together (each replica's, times this) over the model's rate."""
    capacity_max_num_seqs: int = Field(default=256, ge=1)
    """The engine's cap on running sequences, for the headroom's what-if (vLLM's
    `--max-num-seqs`)."""
    capacity_max_num_batched_tokens: int = Field(default=8192, ge=1)
    """The engine's token budget per step, for the headroom's what-if."""
    capacity_objective: float = Field(default=0.95, gt=0, le=1)
    """The share of requests (TTFT) and of token gaps (ITL) within their thresholds that meets
    an SLO, for the headroom."""

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, value: str) -> str:
        if value.startswith(("postgresql://", "postgres://")):
            raise ValueError("use the asyncpg driver: postgresql+asyncpg://...")
        if not value.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError("must start with sqlite+aiosqlite:// or postgresql+asyncpg://")
        return value

    @field_validator("metrics_dir", mode="before")
    @classmethod
    def _metrics_dir_named(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            raise ValueError("is empty: unset it, or name a directory")
        return value

    @property
    def upstream_base(self) -> str:
        """The upstream URL without a trailing slash, ready for path joining."""
        return str(self.upstream_url).rstrip("/")

    @property
    def engine_metrics_target(self) -> str | None:
        """Where the engine's metrics are scraped; None when scraping is off."""
        if not self.engine_metrics_enabled:
            return None
        if self.engine_metrics_url is not None:
            return str(self.engine_metrics_url)
        return self.upstream_base + "/metrics"


def describe(exc: ValidationError, prefix: str) -> str:
    """One sentence per bad setting, named by its environment variable."""
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        variable = field if field.isupper() else prefix + field.upper()  # an alias is its own
        problems.append(f"{variable}={error.get('input')!r} is invalid: {error['msg']}")
    return "; ".join(problems)


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from the environment (and overrides), or raise SettingsError saying why."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(describe(exc, ENV_PREFIX)) from None
