"""The schema: runs, steps, rollouts, prompts and a generic per-step metric series."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """Timezone-aware now, the only clock the store uses."""
    return datetime.now(UTC)


class RunStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"
    lost = "lost"


ACTIVE_STATUSES = (RunStatus.queued, RunStatus.running)


class EndedBy(enum.StrEnum):
    """Who ended a run (runs.ended_by); a cancel from the dashboard says whose (`by_dashboard`)."""

    recorder = "recorder"  # the process that recorded it finished it (a script, the callback)
    worker = "worker"  # the dashboard's worker that trained a launched run
    sweeper = "sweeper"  # no heartbeat for ROLLOUT_LENS_LOST_AFTER_SECONDS: marked lost
    dashboard = "dashboard"  # cancelled from the dashboard (its page, form or API)


def by_dashboard(who: str | None) -> str:
    """runs.ended_by of a cancel from the dashboard by `who` (the Guard's name of the caller:
    `token 1a2b3c4d`, never a token); `dashboard` alone on one without tokens."""
    return f"{EndedBy.dashboard} ({who[:180]})" if who else EndedBy.dashboard.value


def dashboard_caller(ended_by: str | None) -> str | None:
    """Who cancelled from the dashboard (by_dashboard's `who`), else None."""
    prefix = f"{EndedBy.dashboard} ("
    if ended_by and ended_by.startswith(prefix) and ended_by.endswith(")"):
        return ended_by[len(prefix) : -1]
    return None


class RunSource(enum.StrEnum):
    """How a run got in: launched here, recorded by the TRL callback, or imported."""

    launched = "launched"
    callback = "callback"  # a user's own GRPOTrainer with RolloutLensCallback
    trl_import = "trl-import"  # TRL's completions/*.parquet
    verl_import = "verl-import"  # verl's rollout dumps ({step}.jsonl)
    nemo_rl_import = "nemo-rl-import"  # NeMo-RL's training dumps (train_data_step{N}.jsonl)
    slime_import = "slime-import"  # slime's and miles' debug dumps ({rollout_id}.pt)
    import_ = "import"  # a file written by `rollout-lens export`


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class RunRow(Base):
    __tablename__ = "runs"
    __table_args__ = (Index("uq_runs_record_key", "record_key", unique=True),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.queued, index=True)
    variant: Mapped[str | None] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(500))
    k: Mapped[int | None] = mapped_column(Integer)
    group_size: Mapped[int] = mapped_column(Integer)
    prompts_per_step: Mapped[int] = mapped_column(Integer, default=1)
    seed: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer)
    # The launch config as validated (free-form: anything the trainer took).
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Order matters: rollouts' packed control-token probabilities follow it row by row.
    control_tokens: Mapped[list[str]] = mapped_column(JSON, default=list)

    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    worker_host: Mapped[str | None] = mapped_column(String(255))
    device: Mapped[str | None] = mapped_column(String(64))
    device_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    cost: Mapped[float] = mapped_column(Float, default=0.0)
    error: Mapped[str | None] = mapped_column(Text)
    # Launch and control: the broker task that trains it, a cancel request, the last checkpoint.
    task_id: Mapped[str | None] = mapped_column(String(64))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    checkpoint_step: Mapped[int | None] = mapped_column(Integer)
    # Where the run came from; anything but `launched` is external (no resume from here).
    source: Mapped[str] = mapped_column(
        String(16), default=RunSource.launched, server_default=RunSource.launched.value
    )
    # What a recorder could not keep (database away longer than its buffer) and other notes on
    # what was recorded (e.g. no control-token probabilities under vLLM generation).
    dropped_steps: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    dropped_rollouts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    notes: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")
    # What a claimed run is doing before its first step (its model being built, loading): the
    # pages say so instead of "step 0". Cleared when it starts training and when it ends.
    phase: Mapped[str | None] = mapped_column(String(200))

    # Names of the generic per-step series, in the order of each step's packed `series` array
    # (append-only: a name keeps its place for the life of the run).
    series_names: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")
    # Retention: token-level arrays are kept every N steps (and at the first and last step and
    # wherever an alert fires); None keeps them at every step.
    keep_tokens_every: Mapped[int | None] = mapped_column(Integer)
    # Alerts are evaluated as steps are written; this is the last step they were evaluated at.
    alerts_through: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    # A run recorded over HTTP (/api/record): the recorder's own key for it (a retried create
    # finds the run it made) and a fingerprint of the token that created it (only that token, or
    # a full access token, may write to it). NULL for every other run.
    # Unique by an index, not a constraint: SQLite adds an index to a table in place, where a
    # constraint would rebuild `runs` (and its foreign keys would empty every table under it).
    record_key: Mapped[str | None] = mapped_column(String(64))
    recorded_by: Mapped[str | None] = mapped_column(String(64))
    # Goes up by one each time a trainer resumes the run from a checkpoint: steps sent under an
    # older epoch come from the process the resume replaced (migration 0017).
    record_epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Who ended a run that is no longer running (EndedBy): the recorder that finished it, the
    # dashboard's cancel, the sweeper, the worker; NULL for runs ended before migration 0017.
    # A launched run asked to stop keeps who asked here until its worker stops it.
    ended_by: Mapped[str | None] = mapped_column(String(200))

    # Summary columns kept current by every step write, so lists never scan steps.
    current_step: Mapped[int] = mapped_column(Integer, default=0)
    recent_true_accuracy: Mapped[float | None] = mapped_column(Float)
    recent_reward: Mapped[float | None] = mapped_column(Float)


class PromptRow(Base):
    """Each distinct prompt text once; rollouts refer to it (a 64-tool listing is a few KB)."""

    __tablename__ = "prompts"

    id: Mapped[int] = mapped_column(primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    text: Mapped[str] = mapped_column(Text)


class FactsRow(Base):
    """Each distinct set of facts shared by a group's rollouts once (the prompt's listed tool ids,
    query, hint, dataset row…): the part of a rollout's meta that all of its group agree on."""

    __tablename__ = "facts"

    id: Mapped[int] = mapped_column(primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)


class RunTokenRow(Base):
    """The text of each token id a run's completions used, once per run: the viewer shows a
    completion token by token from its ids and these."""

    __tablename__ = "run_tokens"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    token_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    text: Mapped[str] = mapped_column(Text)


class StepRow(Base):
    __tablename__ = "steps"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    # The step whose rollouts this update trained on (differs when GRPO reuses generations).
    rollout_step: Mapped[int] = mapped_column(Integer)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    wall_time: Mapped[float | None] = mapped_column(Float)

    reward_mean: Mapped[float | None] = mapped_column(Float)
    true_accuracy: Mapped[float | None] = mapped_column(Float)
    format_valid_rate: Mapped[float | None] = mapped_column(Float)
    vote_agreement: Mapped[float | None] = mapped_column(Float)
    vote_entropy: Mapped[float | None] = mapped_column(Float)
    zero_std_share: Mapped[float | None] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    kl: Mapped[float | None] = mapped_column(Float)
    entropy: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    learning_rate: Mapped[float | None] = mapped_column(Float)
    completion_length: Mapped[float | None] = mapped_column(Float)
    # These columns are server.core.vocab.STEP_SERIES (labels, units and order are named there).

    # Every other series logged at this step: float64 values in the order of RunRow.series_names
    # (NaN where a name was not logged); server.store.packing.
    series: Mapped[bytes | None] = mapped_column(LargeBinary)
    # False once retention dropped the token-level arrays of this step's rollouts.
    tokens_kept: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())


class RolloutRow(Base):
    """One rollout's scalars: what is filtered, sorted and listed (the explorer reads only these);
    its per-token arrays are in RolloutData."""

    __tablename__ = "rollouts"
    # The unique constraint doubles as the index for "all rollouts of run R at step S"; the
    # explorer filters and sorts a run's rollouts by the other indexed columns.
    __table_args__ = (
        UniqueConstraint("run_id", "step", "group", "idx"),
        *(
            Index(f"ix_rollouts_run_id_{column}", "run_id", column)
            for column in (
                "format_state",
                "format_valid",
                "vote",
                "target",
                "verifier_reward",
                "true_score",
                "advantage",
                "n_tokens",
                "disagree",
            )
        ),
        # The mismatch columns (0021): partial on PostgreSQL, where a run without a generator
        # side would otherwise hold a tiny index of NULLs that the planner took for its other
        # run_id look-ups (the search's walk of a run's prompts); its nullable sorts never read
        # an index's order there (NULLS FIRST going up), so nothing is lost. Whole on SQLite,
        # whose nullable sorts walk them.
        *(
            Index(
                f"ix_rollouts_run_id_{column}",
                "run_id",
                column,
                postgresql_where=text(f"{column} IS NOT NULL"),
            )
            for column in ("abs_diff_max", "log_seq_ratio")
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    group: Mapped[int] = mapped_column("group", Integer)
    index: Mapped[int] = mapped_column("idx", Integer)
    prompt_id: Mapped[int] = mapped_column(ForeignKey("prompts.id"), index=True)
    target: Mapped[str | None] = mapped_column(String(256))  # records.LABEL_CHARS
    vote: Mapped[str | None] = mapped_column(String(256))
    verifier_reward: Mapped[float] = mapped_column(Float)
    true_score: Mapped[float | None] = mapped_column(Float)
    advantage: Mapped[float] = mapped_column(Float)
    sum_logprob: Mapped[float | None] = mapped_column(Float)  # None: NaN (a NaN logprob)
    format_valid: Mapped[bool | None] = mapped_column(Boolean)  # None: nothing judged it
    format_state: Mapped[str | None] = mapped_column(String(32))
    # server.core.records.disagrees(verifier_reward, true_score), kept so that it can be filtered on.
    disagree: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Training–inference mismatch (server.core.mismatch.rollout_figures over the logprobs as
    # stored): the largest |Δlogp| of its compared tokens and the log of its sequence ratio,
    # Σ log(p_trainer / p_generator). NULL: no generator side, or no token to compare.
    abs_diff_max: Mapped[float | None] = mapped_column(Float)
    log_seq_ratio: Mapped[float | None] = mapped_column(Float)
    # The completion's length in tokens, and how its text comes back (server.store.arrays):
    # a TEXT_RULES id when the run's token texts of its ids rebuild it exactly, else NULL and
    # the text is in RolloutDataRow.text.
    n_tokens: Mapped[int | None] = mapped_column(Integer)  # None: not known (no ids kept)
    text_rule: Mapped[int | None] = mapped_column(Integer)
    # The rollout's meta is facts (shared with its group, stored once) plus its own keys.
    facts_id: Mapped[int | None] = mapped_column(ForeignKey("facts.id"), index=True)
    own_meta: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    facts: Mapped[FactsRow | None] = relationship(lazy="joined")
    data: Mapped[RolloutDataRow | None] = relationship(lazy="joined")

    @property
    def meta(self) -> dict[str, Any]:
        """Env facts and recorder extras, as the trainer handed them (token texts aside)."""
        return {**(self.facts.data if self.facts else {}), **(self.own_meta or {})}

    @property
    def tokens_kept(self) -> bool:
        """False where retention dropped the per-token logprobs and control-token
        probabilities (ids stay: they are the text)."""
        return self.data is not None and self.data.logprobs is not None


class RolloutDataRow(Base):
    """A rollout's per-token arrays, compressed (server.store.arrays): apart from its scalars so
    that scanning a run's rollouts never reads them."""

    __tablename__ = "rollout_data"

    rollout_id: Mapped[int] = mapped_column(
        ForeignKey("rollouts.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)  # NULL: retention dropped it
    # The generator's logprobs of the same tokens (the same codec); NULL: the generation path
    # gave none, or retention dropped them.
    generator_logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)
    control: Mapped[bytes | None] = mapped_column(LargeBinary)  # NULL: retention dropped it
    text: Mapped[bytes | None] = mapped_column(LargeBinary)  # NULL: rebuilt from ids


class PromptGroupRow(Base):
    """One group's figures (server.core.prompt_rules.group_figures), written with its rollouts:
    a prompt's history and the heatmap read these, never the rollouts' scan."""

    __tablename__ = "prompt_groups"
    __table_args__ = (Index("ix_prompt_groups_run_prompt", "run_id", "prompt_id", "step"),)

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    group: Mapped[int] = mapped_column("group", Integer, primary_key=True, autoincrement=False)
    prompt_id: Mapped[int] = mapped_column(ForeignKey("prompts.id"))
    size: Mapped[int] = mapped_column(Integer)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_min: Mapped[float | None] = mapped_column(Float)
    reward_max: Mapped[float | None] = mapped_column(Float)
    reward_n: Mapped[int] = mapped_column(Integer)
    true_n: Mapped[int] = mapped_column(Integer)
    true_mean: Mapped[float | None] = mapped_column(Float)
    correct: Mapped[int] = mapped_column(Integer)
    solved: Mapped[bool | None] = mapped_column(Boolean)  # by majority; None: no true score
    zero_spread: Mapped[bool] = mapped_column(Boolean)
    agreement: Mapped[float | None] = mapped_column(Float)
    votes: Mapped[list[Any]] = mapped_column(JSON)  # [[vote, count], ...], most first


class RunPromptRow(Base):
    """A run's prompt, its groups folded in step order (server.core.prompt_rules.PromptFold):
    one row a distinct prompt of the run, kept current by every write, so the prompts list
    reads a row a prompt."""

    __tablename__ = "run_prompts"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    prompt_id: Mapped[int] = mapped_column(
        ForeignKey("prompts.id"), primary_key=True, autoincrement=False
    )
    groups: Mapped[int] = mapped_column(Integer)
    rollouts: Mapped[int] = mapped_column(Integer)
    first_step: Mapped[int] = mapped_column(Integer)
    last_step: Mapped[int] = mapped_column(Integer)
    last_group: Mapped[int] = mapped_column(Integer)
    reward_sum: Mapped[float] = mapped_column(Float)
    reward_n: Mapped[int] = mapped_column(Integer)
    true_sum: Mapped[float] = mapped_column(Float)
    true_n: Mapped[int] = mapped_column(Integer)
    solved_groups: Mapped[int] = mapped_column(Integer)
    solved_at: Mapped[int | None] = mapped_column(Integer)
    last_solved: Mapped[int | None] = mapped_column(Integer)
    last_failed: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[bool | None] = mapped_column(Boolean)
    flips: Mapped[int] = mapped_column(Integer)
    zero_spread: Mapped[int] = mapped_column(Integer)
    votes: Mapped[list[Any]] = mapped_column(JSON)  # [[vote, count], ...] over all its groups
    # What tells it apart: the query its rollouts' meta names, else its last user turn (a head
    # of LABEL_CHARS); and what matches it across runs: sha256 of that query (else of the last
    # user turn) and of the last user turn.
    label: Mapped[str] = mapped_column(Text)
    query_key: Mapped[str] = mapped_column(String(64))
    user_key: Mapped[str] = mapped_column(String(64))
    target: Mapped[str | None] = mapped_column(String(256))


# Steps per bucket: a chart of any run length reads few rows; 25 is the run page's bucket table
# (server.core.vocab.WINDOW).
ROLLUP_WIDTHS = (10, 25, 100, 1000)
CHART_WIDTHS = (10, 100, 1000)  # the ones charts read: at most a few hundred buckets each


class RollupRow(Base):
    """Count, sum, min, max, first and last step of every series over one finished bucket of
    `width` steps, packed (server.rollups): a long run's chart reads a few hundred rows.

    Written when a step lands past the bucket's end; the open bucket is read from the steps.
    """

    __tablename__ = "rollups"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    width: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class AlertRow(Base):
    """An alert, written with the step it fired at (server.core.alerts names the rules)."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_run_step", "run_id", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(64))
    series: Mapped[str | None] = mapped_column(String(200))
    message: Mapped[str] = mapped_column(Text)
    # Its webhook delivery (ROLLOUT_LENS_ALERT_WEBHOOK): NULL waiting, `sent`, `failed` (after
    # every retry; notify_error says why), `before` (recorded before deliveries existed).
    notify_state: Mapped[str | None] = mapped_column(String(16), index=True)
    notify_error: Mapped[str | None] = mapped_column(Text)


class BrowserSessionRow(Base):
    """A browser signed in with an access token (server/store/browser_sessions.py): kept here, so that
    signing out ends it and no other server knows it.

    Holds the SHA-256 of the cookie's random value (a database reader cannot replay a cookie),
    an HMAC of the token it signed in with (never the token: changing the tokens ends it), and
    when it expires.
    """

    __tablename__ = "sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_digest: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
