"""The export file's records: a run header, steps, rollouts and an end record (JSONL and Parquet).

One shape for both formats. A JSONL export is these records one per line, in order: the run, then
each step followed by the rollouts generated at it, then `end` with the counts (a file cut short
has no `end`). A Parquet export holds the rollouts as rows and the run, step and end records as
JSON in the file's key-value metadata (see server.exchange.export).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rollout_lens.server.core.display import iso
from rollout_lens.server.core.vocab import STEP_SERIES
from rollout_lens.server.store.models import RolloutRow, RunRow, StepRow
from rollout_lens.server.store.serialize import rollout_dict

FORMAT = "rollout-lens-export"
VERSION = 1
# Parquet key-value metadata keys (values: JSON text; steps: one JSON object per line).
META_RUN = b"rollout_lens.run"
META_STEPS = b"rollout_lens.steps"
META_END = b"rollout_lens.end"

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
    id: int
    name: str
    status: Literal["queued", "running", "completed", "failed", "cancelled", "lost"]  # RunStatus
    source: str
    variant: str | None
    model: str
    k: int | None
    group_size: int
    prompts_per_step: int
    seed: int
    total_steps: int
    config: dict[str, Any]
    control_tokens: list[str]
    notes: list[str]
    worker_host: str | None
    device: str | None
    device_seconds: float
    cost: float
    error: str | None
    dropped_steps: int
    dropped_rollouts: int
    current_step: int
    recent_true_accuracy: float | None
    recent_reward: float | None
    created_at: Time
    started_at: Time
    finished_at: Time
    heartbeat_at: Time


class StepLine(_Record):
    kind: Literal["step"]
    step: int
    rollout_step: int
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


class RolloutLine(_Record):
    kind: Literal["rollout"]
    run_id: int
    step: int
    group: int
    index: int
    prompt: str
    completion: str
    completion_ids: list[int]
    vote: str | None
    target: str | None
    verifier_reward: float
    true_score: float | None
    advantage: float
    sum_logprob: float | None  # None: not a number (a NaN logprob)
    format_valid: bool | None  # None: nothing judged it (no format_valid function)
    format_state: str | None
    token_logprobs: list[float]
    control_token_probs: dict[str, list[float]]
    meta: dict[str, Any]
    # Each completion token's text (absent from files of older versions, which kept them in
    # meta["tokens"]; the importer reads either).
    tokens: list[str] | None = None


class EndLine(_Record):
    kind: Literal["end"]
    steps: int
    rollouts: int


RECORDS: dict[str, type[_Record]] = {
    "run": RunRecord,
    "step": StepLine,
    "rollout": RolloutLine,
    "end": EndLine,
}


def validation_text(exc: ValidationError) -> str:
    """A pydantic error as one line: field: message; ..."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'record'}: {err['msg']}" for err in exc.errors()
    )
