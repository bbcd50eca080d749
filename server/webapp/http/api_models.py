"""The JSON API's response shapes, for the OpenAPI schema and /docs (documentation only: the
routes send the queries' dicts as they are, so these list the fields a client can rely on and
allow more)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from rollout_lens.server.core.read_models import Rollout


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Run(_Open):
    """A run's columns: recipe, status, progress and its last-25-step figures."""

    id: int
    name: str
    status: str = Field(description="queued, running, completed, failed, cancelled or lost")
    source: str = Field(description="launched, callback, trl-import or import")
    variant: str | None
    model: str
    k: int | None = Field(description="shortlist size of a patched run; null for leaky")
    group_size: int
    seed: int
    total_steps: int
    current_step: int
    recent_true_accuracy: float | None = Field(description="mean of the last 25 steps")
    recent_reward: float | None = Field(description="mean of the last 25 steps")
    phase: str | None = Field(
        None, description="what a claimed run does before its first step (building its model)"
    )
    created_at: str | None = Field(description="ISO 8601, UTC with its zone (+00:00)")
    started_at: str | None = Field(description="ISO 8601, UTC with its zone")
    finished_at: str | None = Field(description="ISO 8601, UTC with its zone")
    ended_by: str | None = Field(
        None,
        description="who ended it: recorder, worker, sweeper (lost: no heartbeat), or "
        "`dashboard (token 1a2b3c4d)` for a cancel; for a launched run still running, who "
        "asked it to stop",
    )


class Links(_Open):
    prev: str | None
    next: str | None


class RunsPage(_Open):
    """One page of runs, newest first unless sorted otherwise."""

    runs: list[Run]
    total: int
    page: int
    per_page: int
    pages: int
    links: Links


class Alert(_Open):
    kind: str = Field(description="reward_hacking, collapse, control_token_spike, signal_loss…")
    step: int
    message: str
    severity: str = Field(description="warning or info")
    url: str = Field(description="the step's page")


class Progress(_Open):
    """A run's live state (what live pages poll)."""

    id: int
    status: str
    current_step: int
    total_steps: int
    active: bool
    summary: str = Field(description="one line: place in the queue, speed and ETA, or its end")
    steps_per_second: float | None
    eta_seconds: float | None
    can_cancel: bool
    can_resume: bool


class RunOverview(_Open):
    run: Run
    first_step: int | None
    last_step: int | None
    series_names: list[str]
    live: Progress
    alerts: list[Alert]


class Series(_Open):
    """Chart series: name → {x: steps, y: values, lo/hi: min–max of a downsampled bucket}."""

    run_id: int
    cursor: int = Field(description="pass as the next `since` to get only newer steps")
    bucket: int = Field(description="steps per point (1: not downsampled)")
    method: str
    series: dict[str, dict[str, list[Any]]]
    buckets: dict[str, list[Any]] = Field(
        description="25-step bucket means with their steps: start, end, n, x0, x1, center, partial"
    )


class Presets(_Open):
    presets: list[dict[str, Any]]
    fields: list[dict[str, Any]]


class Compare(_Open):
    runs: list[Run]
    series: dict[str, Any]
    summary: list[dict[str, Any]]
    config_diff: dict[str, Any]


class Step(_Open):
    """A step: its metrics and neighbours and a page of its groups overview (no rollouts)."""

    run: Run
    step: dict[str, Any]
    groups: list[dict[str, Any]] = Field(description="one summary a group, a page of them")
    total: int = Field(description="groups that match (the page's look)")


def _null_for_non_finite(schema: dict[str, Any]) -> None:
    """JSON has no NaN or infinity: the API sends null for them (responses.encode), so any
    number of a rollout (a NaN logprob, an infinite reward) may be null."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if node.get("type") == "number":
                rest = {k: v for k, v in node.items() if k != "type"}
                return {"anyOf": [{"type": "number"}, {"type": "null"}], **rest}
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value) for value in node]
        return node

    schema.update(walk(schema))


class GroupRollout(Rollout):
    """A rollout of a group's page: read_models.Rollout (the one description of a rollout: what
    the export writes), cut to the page's `max_tokens` positions and text budget, with the
    viewer's marks."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_null_for_non_finite)

    tokens_total: int = Field(description="token positions it has in all (the arrays hold fewer)")
    completion_chars: int = Field(description="characters of its completion (the text may be cut)")
    prompt_chars: int = Field(description="characters of its prompt (the text may be cut)")
    disagree: bool = Field(description="the verifier and the truth disagree")
    sampled: list[bool] | None = Field(
        description="a tool-calling rollout's positions the model sampled (null: every one)"
    )


class Group(_Open):
    """One group of a step: its summary and a page of its rollouts with per-token arrays."""

    run: Run
    step: dict[str, Any]
    summary: dict[str, Any]
    rollouts: list[GroupRollout] = Field(
        description="a page of rollouts: `tokens` is each token's text as decoded, "
        "`token_pieces` the tokenizer's raw pieces"
    )
    rollouts_total: int
    next: str | None = Field(description="the next page of rollouts (null at the end)")


class Rollouts(_Open):
    """A page of the explorer: a run's rollouts across steps that match the filters."""

    rollouts: list[dict[str, Any]] = Field(description="one row a rollout, with its links")
    total: int = Field(description="rollouts that match, counted up to 100,000")
    total_capped: bool = Field(description="true when more than 100,000 match")
    next: str | None = Field(description="pass as `after` for the next page (null at the end)")


class Launched(_Open):
    runs: list[dict[str, Any]] = Field(description="the queued runs, each with its page's URL")


class ValidationFailure(_Open):
    detail: str
    errors: list[dict[str, Any]] | dict[str, Any] | None = None


class Deleted(_Open):
    deleted: int = Field(description="the id of the deleted run")
