"""The export file's records: a run header, steps, rollouts and an end record (JSONL and Parquet).

One shape for both formats. A JSONL export is these records one per line, in order: the run, then
each step followed by the rollouts generated at it, then `end` with the counts (a file cut short
has no `end`). A Parquet export holds the rollouts as rows and the run, step and end records as
JSON in the file's key-value metadata (see server.exchange.export).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from rollout_lens.server.core.display import iso
from rollout_lens.server.core.step_views import RolloutJSON
from rollout_lens.server.core.vocab import STEP_SERIES
from rollout_lens.server.exchange.bounds import MAX_INT32, MAX_TOKENS, MIN_INT32
from rollout_lens.server.store.models import RolloutRow, RunRow, StepRow
from rollout_lens.server.store.serialize import rollout_dict

FORMAT = "rollout-lens-export"
VERSION = 1
# Parquet key-value metadata keys (values: JSON text; steps: one JSON object per line).
META_RUN = b"rollout_lens.run"
META_STEPS = b"rollout_lens.steps"

# Run columns an export carries; ids and this database's launch machinery (broker task, cancel
# flag, checkpoint) are left out: they mean nothing in another database.
RUN_TIMES = ("created_at", "started_at", "finished_at", "heartbeat_at")
RUN_AFTER_STEPS = (  # restored once the steps are written (writing a step refreshes them)
    *RUN_TIMES,
    "worker_host",
    "device",
    "device_seconds",
    "cost",
    "error",
    "dropped_steps",
    "dropped_rollouts",
    "current_step",
    "recent_true_accuracy",
    "recent_reward",
)
Time = Annotated[datetime | None, Field(strict=False)]  # ISO 8601 text in the file

# What the databases store, checked per record as it is read (a value out of range is refused
# naming its line before anything is written; SQLite raised OverflowError past 64 bits, and
# steps, ids and counts are 32-bit columns).
Int32 = Annotated[int, Field(ge=MIN_INT32, le=MAX_INT32)]
Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
StepNo = Annotated[int, Field(ge=0, le=MAX_INT32)]  # a negative step could not be viewed
RunIdNo = Annotated[int, Field(ge=0, le=2**63 - 1)]


def _not_nan(value: float) -> float:
    if value != value:
        raise ValueError("NaN is not a number this field holds (null where there is none)")
    return value


Number = Annotated[float, AfterValidator(_not_nan)]  # ±infinity is stored as it is, NaN is not


def dumps(record: dict[str, Any]) -> str:
    """One record as compact JSON; NaN and ±infinity as the tokens NaN, Infinity, -Infinity."""
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


# --- writing ------------------------------------------------------------------------------------


def run_record(run: RunRow) -> dict[str, Any]:
    """The header record: the run's own columns."""
    return {
        "kind": "run",
        "format": FORMAT,
        "version": VERSION,
        "id": run.id,
        "name": run.name,
        "status": run.status,
        "source": run.source,
        "variant": run.variant,
        "model": run.model,
        "k": run.k,
        "group_size": run.group_size,
        "prompts_per_step": run.prompts_per_step,
        "seed": run.seed,
        "total_steps": run.total_steps,
        "config": run.config,
        "control_tokens": run.control_tokens,
        "notes": run.notes,
        "worker_host": run.worker_host,
        "device": run.device,
        "device_seconds": run.device_seconds,
        "cost": run.cost,
        "error": run.error,
        "ended_by": run.ended_by,
        "dropped_steps": run.dropped_steps,
        "dropped_rollouts": run.dropped_rollouts,
        "current_step": run.current_step,
        "recent_true_accuracy": run.recent_true_accuracy,
        "recent_reward": run.recent_reward,
    } | {name: iso(getattr(run, name)) for name in RUN_TIMES}


def step_record(step: StepRow, metrics: dict[str, float | None]) -> dict[str, Any]:
    """A step's columns and its generic series."""
    return (
        {
            "kind": "step",
            "step": step.step,
            "rollout_step": step.rollout_step,
            "recorded_at": iso(step.recorded_at),
        }
        | {name: getattr(step, name) for name in STEP_SERIES}
        | {"metrics": metrics}
    )


def rollout_record(
    rollout: RolloutRow, prompt: str, control_tokens: list[str], token_texts: dict[int, str]
) -> dict[str, Any]:
    """A rollout with every array (the API's rollout shape, plus its kind). Where retention
    dropped its token arrays they are empty lists."""
    record: dict[str, Any] = {
        "kind": "rollout",
        **rollout_dict(rollout, prompt, control_tokens, token_texts),
    }
    del record["tokens_kept"]
    return record


def end_record(steps: int, rollouts: int) -> dict[str, Any]:
    """The last record: how many steps and rollouts came before it."""
    return {"kind": "end", "steps": steps, "rollouts": rollouts}


# --- reading ------------------------------------------------------------------------------------


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class RunRecord(_Record):
    kind: Literal["run"]
    format: str
    version: int
    id: RunIdNo
    name: str = Field(max_length=200)  # the runs table's column lengths
    status: Literal["queued", "running", "completed", "failed", "cancelled", "lost"]  # RunStatus
    source: str = Field(max_length=16)
    variant: str | None = Field(max_length=32)
    model: str = Field(max_length=500)
    k: Int32 | None
    group_size: Count
    prompts_per_step: Count
    seed: Int32
    total_steps: Count
    config: dict[str, Any]
    control_tokens: list[str]
    notes: list[str]
    worker_host: str | None = Field(max_length=255)
    device: str | None = Field(max_length=64)
    device_seconds: Number
    cost: Number
    error: str | None
    # who or what ended the run (runs.ended_by: EndedBy, `dashboard (token …)`); an export
    # written before it was carried has none
    ended_by: str | None = Field(default=None, max_length=200)
    dropped_steps: Count
    dropped_rollouts: Count
    current_step: StepNo
    recent_true_accuracy: Number | None
    recent_reward: Number | None
    created_at: Time
    started_at: Time
    finished_at: Time
    heartbeat_at: Time


class StepLine(_Record):
    kind: Literal["step"]
    step: StepNo
    rollout_step: StepNo
    recorded_at: Time
    reward_mean: float | None
    true_accuracy: float | None
    format_valid_rate: float | None
    vote_agreement: float | None
    vote_entropy: float | None
    zero_std_share: float | None
    loss: float | None
    kl: float | None
    entropy: float | None
    grad_norm: float | None
    learning_rate: float | None
    completion_length: float | None
    wall_time: float | None
    metrics: dict[str, float | None]

    def values(self) -> dict[str, float | None]:
        """The step columns by name."""
        return {name: getattr(self, name) for name in STEP_SERIES}


class RolloutLine(RolloutJSON):  # type: ignore[misc,valid-type]  # derived from the view
    """A rollout record: step_views.RolloutJSON (the read view's JSON, every field of it) with its kind, checked as strictly as the other records and narrowed to what the
    databases store. A file has no tokens_kept (its arrays say it); files before
    generator_logprobs have none (null: the generation path gave none); files of older versions
    have no tokens (they kept them in meta["tokens"]) and those and files before token_pieces
    hold the raw pieces in tokens (stored_pieces)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    kind: Literal["rollout"]
    run_id: RunIdNo
    step: StepNo
    group: Count
    index: Count
    completion_ids: list[Int32] = Field(max_length=MAX_TOKENS)
    verifier_reward: Number
    advantage: Number
    format_state: str | None = Field(max_length=32)

    def stored_pieces(self) -> list[str] | None:
        """The pieces to store for this rollout's ids: token_pieces, else (older files) tokens."""
        pieces: list[str] | None = (
            self.token_pieces if self.token_pieces is not None else self.tokens
        )
        return pieces

    @model_validator(mode="after")
    def _one_length(self) -> RolloutLine:
        """Every per-token array has one entry per completion token (or none: retention dropped
        logprobs and control-token probabilities, an older file has no token texts)."""
        n = len(self.completion_ids)
        arrays: dict[str, Sequence[object]] = {
            "token_logprobs": self.token_logprobs,
            "tokens": self.tokens or [],
        }
        arrays |= {f"control_token_probs[{t!r}]": p for t, p in self.control_token_probs.items()}
        for name, values in arrays.items():
            if values and len(values) != n:
                raise ValueError(
                    f"{name} has {len(values)} entries for {n} completion_ids (one per token)"
                )
        generator = self.generator_logprobs
        if generator is not None and len(generator) != n:
            raise ValueError(
                f"generator_logprobs has {len(generator)} entries for {n} completion_ids (one "
                "per token, or null: none given)"
            )
        return self


class EndLine(_Record):
    kind: Literal["end"]
    steps: int
    rollouts: int


RECORDS: dict[str, type[BaseModel]] = {
    "run": RunRecord,
    "step": StepLine,
    "rollout": RolloutLine,
    "end": EndLine,
}


def validation_text(exc: ValidationError, *, most: int = 3) -> str:
    """A pydantic error as one line: field: message; ... (the first `most`: a list of a million
    bad ids is one sentence, not a million)."""
    errors = exc.errors()
    text = "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'record'}: {err['msg']}" for err in errors[:most]
    )
    return text + (f"; and {len(errors) - most:,} more" if len(errors) > most else "")
