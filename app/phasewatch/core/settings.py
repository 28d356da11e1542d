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
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True,
                                      populate_by_name=True)

    # Where the OpenAI-compatible engine (vLLM) listens.
    upstream_url: AnyHttpUrl = Field(default=AnyHttpUrl("http://127.0.0.1:8000"))
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    # Processes serving that one port (`phasewatch serve --workers N`). One by default: a worker
    # buys a core, not efficiency (each has its own upstream pool and record writer, and their
    # metrics go through files), so add workers when one core no longer keeps up; README, "How
    # to scale".
    workers: int = Field(default=1, ge=1, le=256)
    # Where each worker keeps its metrics, for any worker to serve them all on /metrics: the
    # variable prometheus_client itself reads. `phasewatch serve` sets it (a fresh temporary
    # directory) when it runs more than one worker; set it to choose the place (a tmpfs).
    metrics_dir: Path | None = Field(default=None, validation_alias="PROMETHEUS_MULTIPROC_DIR")

    # Upstream connection policy. A stream may sit silent for a long queue wait or a long
    # prefill, so the only read timeout is the gap allowed between two reads, and it is long.
    upstream_connect_timeout_s: float = Field(default=10.0, gt=0)
    upstream_idle_timeout_s: float = Field(default=600.0, gt=0)
    # Open connections to the upstream at once; 0 means no limit.
    upstream_max_connections: int = Field(default=0, ge=0)
    # Ask the upstream for per-chunk usage (`continuous_usage_stats`, a vLLM extension) so
    # each chunk's token count is exact. Turn off for upstreams that reject the field.
    upstream_continuous_usage: bool = True
    # Relay the running token chunks of an exactly counted stream in the native thread
    # (app/phasewatch/proxy/native.py) on Linux; off: every read goes through Python.
    native_relay: bool = True
    # A request's head (and a new connection's first one) must arrive within this long, or the
    # client gets a 408 and the connection is closed: a half-sent head holds nothing forever.
    client_head_timeout_s: float = Field(default=30.0, gt=0)
    # A client that takes nothing of its stream for this long (its socket buffer full) is cut
    # off and its upstream request closed, rather than holding an engine slot until the
    # upstream idle timeout.
    client_stall_timeout_s: float = Field(default=60.0, gt=0)
    # A decoding stream silent for longer than this counts as stalled on the live gauge
    # `phasewatch_streams_stalled` (a long prefill of another request, a stuck engine).
    stall_threshold_s: float = Field(default=5.0, gt=0)

    # The SLO thresholds; they become exact bucket edges of the TTFT and ITL histograms.
    slo_ttft_s: float = Field(default=0.5, gt=0)
    slo_itl_s: float = Field(default=0.04, gt=0)

    # The largest request body accepted (bytes); a larger one is answered 413 and never read
    # whole. 16 MiB holds any text prompt of a long context (and token-id prompts) with room.
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    # Shutdown (README, "Stopping"): on SIGTERM open streams may run this long before they are
    # ended with an in-band error; keep it below the orchestrator's kill deadline (Kubernetes'
    # terminationGracePeriodSeconds) less `shutdown_flush_s` and a few seconds.
    shutdown_grace_s: float = Field(default=60.0, ge=0)
    # Then the queued records are stored for up to this long.
    shutdown_flush_s: float = Field(default=10.0, gt=0)
    # Readiness (`/api/ready`) fails once records have failed to store for this long.
    ready_writer_failing_s: float = Field(default=30.0, gt=0)
    # The admin surface (/api, the API docs, the run-id header): closed unless a token is set
    # (then callers send it as x-phasewatch-admin-token) or it is opened to everyone.
    admin_token: SecretStr | None = None
    admin_open: bool = False
    # A scrape of /metrics is rendered off the event loop and reused for this long, so that
    # any number of scrapers costs at most one render per interval.
    metrics_cache_s: float = Field(default=1.0, ge=0)
    # TTFT and ITL buckets carry the id of a request that landed in them (OpenMetrics
    # exemplars, served when the scraper asks for OpenMetrics; one process only: under
    # several workers prometheus_client keeps none).
    exemplars: bool = True
    # OpenTelemetry (README, "OpenTelemetry (OTLP)"): with the `otel` extra installed, export
    # the GenAI metrics and one span per relayed request over OTLP/HTTP, configured by the
    # standard OTEL_* variables. Off by default; off, no OpenTelemetry code runs.
    otel_enabled: bool = False
    # `gen_ai.provider.name` on what is exported: the engine behind the proxy.
    otel_provider_name: str = Field(default="vllm", min_length=1, max_length=64)
    # uvicorn's access log (one line per request, with its path and query string, which can
    # carry what clients consider private): off unless an operator turns it on.
    access_log: bool = False
    # Client connections a worker holds at once (each stream also needs an upstream one);
    # past it new connections get a 503. 0: as many as the open-file limit allows, which
    # `phasewatch serve` raises to its hard limit ((limit - 64) / 4 with the native relay,
    # whose streams hold a duplicate of both descriptors; (limit - 64) / 2 without).
    max_client_connections: int = Field(default=0, ge=0)
    # Distinct model names that get their own metric label; later ones share "other".
    max_model_labels: int = Field(default=32, ge=1)
    # Finished-request records waiting to be stored; past this, records are dropped and counted.
    record_queue_size: int = Field(default=10_000, ge=1)
    # Bounds of the admin API, which shares the relay's event loop (README, "Read API"):
    # `/api/stats` answers windows up to `api_max_window_s` and reads at most `api_max_rows`
    # rows for its percentiles (a uniform sample of a window that holds more); any `/api` call
    # still running after `api_timeout_s` is stopped, its database query with it, and
    # answered 503.
    api_max_window_s: float = Field(default=7 * 86400.0, gt=0)
    api_max_rows: int = Field(default=20_000, ge=100)
    api_timeout_s: float = Field(default=10.0, gt=0)

    # Where records and runs are stored: an SQLite file by default (created on first start),
    # or `postgresql+asyncpg://user@host:5432/db`.
    database_url: str = "sqlite+aiosqlite:///phasewatch.db"
    # Apply pending migrations at startup instead of refusing to start on an old schema.
    database_auto_upgrade: bool = False
    # The background writer stores records in batches of up to this many, at least this often.
    writer_batch_size: int = Field(default=100, ge=1)
    writer_flush_interval_s: float = Field(default=1.0, gt=0)
    # Raw request rows are kept this long (per-minute rollups are kept); 0 keeps them forever.
    retention_days: float = Field(default=14.0, ge=0)
    retention_interval_s: float = Field(default=300.0, gt=0)

    # Diagnosis (docs/diagnosis.md): every `diagnosis_interval_s`, each active model's last
    # `diagnosis_window_s` is judged against the `diagnosis_baseline_s` before it; the verdict
    # is exported as metrics and each change is stored. 0 turns the schedule off (the API
    # still answers).
    diagnosis_interval_s: float = Field(default=10.0, ge=0)
    diagnosis_window_s: float = Field(default=300.0, gt=0)
    diagnosis_baseline_s: float = Field(default=3600.0, gt=0)
    # The schedule judges the last `diagnosis_recent_s` when it holds enough requests (a change
    # shows within a minute), else the whole window.
    diagnosis_recent_s: float = Field(default=60.0, gt=0)
    # Hysteresis: a new verdict replaces the schedule's current one after this many rounds in a
    # row, or, from healthy to an incident, at once when its confidence is at least
    # `diagnosis_switch_confidence`.
    diagnosis_hold_rounds: int = Field(default=2, ge=1)
    diagnosis_switch_confidence: float = Field(default=0.95, gt=0, le=1)
    # Live snapshots (requests still in flight) count when taken this long before `until`.
    diagnosis_live_max_age_s: float = Field(default=10.0, gt=0)
    # Every process publishes its requests in flight this often (0: never), at most this many.
    # Half the schedule's interval: each round reads a snapshot at most that old. A snapshot
    # costs each open stream's figures, so at a thousand streams it is worth not taking more.
    live_snapshot_interval_s: float = Field(default=5.0, ge=0)
    live_snapshot_max_requests: int = Field(default=1000, ge=1)
    # Timed requests each side needs before anything is judged (else "insufficient data").
    diagnosis_min_samples: int = Field(default=20, ge=5)
    # Requests read per span at most; a larger span is evenly thinned to this many.
    diagnosis_max_samples: int = Field(default=3000, ge=100)
    # The engine's own Prometheus metrics (vLLM's /metrics), read to corroborate a diagnosis.
    # Default: the upstream's /metrics; engine_metrics_enabled=false turns scraping off.
    engine_metrics_url: AnyHttpUrl | None = None
    engine_metrics_enabled: bool = True
    engine_scrape_interval_s: float = Field(default=15.0, gt=0)
    engine_scrape_timeout_s: float = Field(default=5.0, gt=0)
    # Retention, the diagnosis schedule and the engine scrape run in one process per database
    # (app/phasewatch/store/leader.py): the others try to take the lead this often, and the leader
    # checks it still holds it as often.
    leader_check_interval_s: float = Field(default=5.0, gt=0)

    log_level: LogLevel = "info"

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
