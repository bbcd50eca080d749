"""Settings: read once from the environment (prefix ROLLOUT_LENS_) and passed in."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MIN_TOKEN_CHARS = 16


class Settings(BaseSettings):
    """Every knob of Rollout Lens; each field is documented in docs/deployment/settings.md."""

    # hide_input_in_errors: a refused setting's message never repeats its value (a token, or a
    # database URL with its password).
    model_config = SettingsConfigDict(
        env_prefix="ROLLOUT_LENS_", extra="ignore", hide_input_in_errors=True
    )

    data_dir: Path = Field(
        Path(".rollout-lens"),
        description="Folder for the embedded database, models and checkpoints.",
    )
    database_url: str = Field(
        "", description="SQLAlchemy URL; empty means an SQLite file `rollout-lens.db` in data_dir."
    )
    model_cache_dir: Path | None = Field(
        None, description="Where the tiny model is built and cached; default data_dir/models."
    )
    broker_url: str = Field(
        "", description="Celery broker URL (e.g. redis://127.0.0.1:6379/0); empty: embedded broker."
    )
    price_per_device_hour: float = Field(
        2.0, ge=0, description="Price of one device-hour in dollars, for a run's estimated cost."
    )
    checkpoint_every: int = Field(
        50, ge=0, description="Save a resumable checkpoint every N steps (0: never)."
    )
    heartbeat_seconds: float = Field(
        5.0, gt=0, description="How often a training process reports that it is alive."
    )
    lost_after_seconds: float = Field(
        60.0,
        gt=0,
        description="A running (or starting) run with no heartbeat for this long is marked lost.",
    )
    torch_threads: int = Field(
        1,
        ge=0,
        description="CPU threads torch may use when training (0: torch's default, all cores).",
    )
    sqlite_busy_timeout_ms: int = Field(
        30_000, ge=0, description="How long an SQLite writer waits for a lock before failing."
    )
    writer_process: bool = Field(
        True,
        description="Whether a script's recorder, and a launched run's, writes its database from "
        "a process of its own, so that the store's Python shares no GIL with training (off: from "
        "a thread of the training process).",
    )

    auth_token: SecretStr = Field(
        SecretStr(""),
        description="Token(s), comma-separated, that changing anything needs (empty: none).",
    )
    auth_read: bool = Field(False, description="Whether reading also needs a token.")
    session_hours: float = Field(
        12.0,
        gt=0,
        le=24 * 90,
        description="How long a browser stays signed in before it must sign in again.",
    )
    allowed_hosts: str = Field(
        "",
        description="Extra host names (comma-separated) the dashboard answers to; `*`: any.",
    )
    max_queued_runs: int = Field(
        100, ge=1, description="Runs that may wait in the queue; a launch past it is refused."
    )
    server_timing: bool = Field(
        False, description="Add a Server-Timing header (the server's own time) to responses."
    )
    record_token: SecretStr = Field(
        SecretStr(""),
        description="Recording tokens, comma-separated: they may record runs (and read), nothing "
        "else.",
    )
    record_max_mb: float = Field(
        64.0,
        gt=0,
        le=1024,
        description="The largest body of one recording request (a batch of steps), in MiB.",
    )
    alert_webhook: str = Field(
        "",
        description="URL(s), comma-separated, that receive a POST (Slack-compatible JSON) for "
        "each new alert.",
    )
    public_url: str = Field(
        "",
        description="The dashboard's address as people reach it (links in alert webhooks); "
        "default: http://host:port it serves on.",
    )
    # The client's side: where a trainer, the CLI and the client record and read.
    url: str = Field(
        "",
        description="A dashboard's URL: the callback records there, the CLI reads and writes "
        "through its API (empty: the local database).",
    )
    token: SecretStr = Field(
        SecretStr(""), description="The token sent to the dashboard at `url` (Bearer)."
    )

    @field_validator("auth_token", "record_token")
    @classmethod
    def _strong_tokens(cls, value: SecretStr) -> SecretStr:
        """Refuse a token short enough to guess; the message never shows a token."""
        tokens = [t.strip() for t in value.get_secret_value().split(",") if t.strip()]
        short = [str(i) for i, t in enumerate(tokens, start=1) if len(t) < MIN_TOKEN_CHARS]
        if short:
            which = f"token {short[0]}" if len(short) == 1 else f"tokens {', '.join(short)}"
            raise ValueError(
                f"each access token needs at least {MIN_TOKEN_CHARS} characters (a short one "
                f"can be guessed); {which} of {len(tokens)} is shorter. Make one with: "
                "python -c 'import secrets; print(secrets.token_urlsafe(24))'"
            )
        return value

    @model_validator(mode="after")
    def _derive_paths(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'rollout-lens.db').as_posix()}"
        if self.model_cache_dir is None:
            self.model_cache_dir = self.data_dir / "models"
        return self

    @property
    def auth_token_list(self) -> list[str]:
        """The access tokens (never logged or shown)."""
        return [t.strip() for t in self.auth_token.get_secret_value().split(",") if t.strip()]

    @property
    def record_token_list(self) -> list[str]:
        """The recording tokens (never logged or shown)."""
        return [t.strip() for t in self.record_token.get_secret_value().split(",") if t.strip()]

    @property
    def record_max_bytes(self) -> int:
        return int(self.record_max_mb * 2**20)

    @property
    def alert_webhook_list(self) -> list[str]:
        return [u.strip() for u in self.alert_webhook.split(",") if u.strip()]

    @property
    def allowed_host_list(self) -> list[str]:
        return [h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip()]

    def run_dir(self, run_id: int) -> Path:
        """Where a run's checkpoints and other files go (deleted with the run)."""
        return self.data_dir / "runs" / str(run_id)

    @property
    def models_dir(self) -> Path:
        """The model cache directory, always set after validation."""
        assert self.model_cache_dir is not None
        return self.model_cache_dir


def get_settings(**overrides: object) -> Settings:
    """Build the settings from the environment, with explicit overrides on top."""
    return Settings(**overrides)  # type: ignore[arg-type]
