"""The named shapes of what the dashboard reads: typed read models built by serialize and the
queries, read by the views, the templates, the JSON API and the Python client.

TypedDicts: at run time they are the plain dicts the JSON API sends as they are (no copy, no
change of a byte), and mypy checks every key each side names. The pages are built on the run
card (RunData), a run's live state (LiveState), a step (StepHead and its StepGroups, a
group's header and its scalar rows); a group in detail and compare hold the read side's typed
rollout views and live beside them, in server.core.step_views.

A rollout is described once, by its read view (server.core.step_views.RolloutView), from
which its JSON, the export's records, the API's models and the client's keys are derived.

Pure shapes: no session, no SQL, no torch, nothing of ours.
"""

from __future__ import annotations

from typing import Any, NotRequired

from typing_extensions import TypedDict

# --- the run card and its live state ------------------------------------------------------------


class RunData(TypedDict):
    """A run's columns, JSON-ready (serialize.run_dict): the run card, the runs list's rows."""

    id: int
    name: str
    status: str
    source: str
    external: bool  # recorded or imported from elsewhere, not launched here
    variant: str | None
    model: str
    k: int | None
    group_size: int
    prompts_per_step: int
    seed: int
    total_steps: int
    current_step: int
    recent_true_accuracy: float | None
    recent_reward: float | None
    device: str | None
    worker_host: str | None
    device_minutes: float
    cost: float
    error: str | None
    # who ended it (models.EndedBy: `recorder`, `dashboard (token 1a2b3c4d)`…); for a launched
    # run still running, who asked it to stop
    ended_by: str | None
    dropped_steps: int
    dropped_rollouts: int
    notes: list[str]
    phase: str | None
    judged: dict[str, bool]  # which judgements of a completion the recorder could make
    control_tokens: list[str]
    config: dict[str, Any]
    created_at: str | None  # ISO 8601, UTC with its zone
    started_at: str | None
    finished_at: str | None
    heartbeat_at: str | None


class ListedRun(RunData):
    """A row of the runs list (queries.runs_page)."""

    queue_position: int | None
    warnings: int  # its stored alerts that are warnings
    text: dict[str, str]  # data-field → its text (display.live_text)


class ProgressData(TypedDict):
    """The fields of a run that change while it trains (chart_data.run_progress)."""

    id: int
    status: str
    current_step: int
    total_steps: int
    recent_true_accuracy: float | None
    recent_reward: float | None
    device_minutes: float
    cost: float
    error: str | None
    finished_at: str | None
    ended_by: str | None  # who ended it, once it has ended
    phase: str | None
    active: bool
    text: dict[str, str]  # data-field → its text (display.live_text)


class LiveState(ProgressData):
    """What a live page shows besides the charts (queries.run_live)."""

    queue_position: int | None
    steps_per_second: float | None
    eta_seconds: float | None
    cancel_requested: bool
    checkpoint_step: int | None
    can_cancel: bool
    can_resume: bool
    summary: str  # one line: place in the queue, speed and ETA, or its end


class RunOverviewData(TypedDict):
    """A run page's data (queries.run_overview; the routes add its alerts)."""

    run: RunData
    first_step: int | None
    last_step: int | None
    series_names: list[str]
    live: LiveState
    alerts: NotRequired[list[dict[str, Any]]]  # FiredAlert.as_dict with each step's url


# --- a step in detail ---------------------------------------------------------------------------


class StepNav(TypedDict):
    """The recorded steps around one (None at either end)."""

    first: int | None
    prev: int | None
    next: int | None
    last: int | None


class GroupNav(StepNav):
    count: int  # groups at the step


class StepHead(TypedDict):
    """What every view of a step shows (queries.step_head)."""

    run: RunData
    step: dict[str, Any]  # serialize.step_dict: step, rollout_step and the step columns
    metrics: dict[str, float | None]  # every other series logged at the step
    nav: StepNav
    tokens_kept: bool  # retention kept its token-level data
    nearest_kept: int | None  # the nearest step that did, where this one did not
    keep_tokens_every: int | None


class StepGroups(StepHead):
    """A step as its groups overview, a page of them (queries.step_groups)."""

    groups_in_step: int
    rollouts_in_step: int
    counts: dict[str, int]  # look → groups it finds
    sort: str
    order: str  # asc or desc
    look: str | None
    total: int  # groups that match the look
    offset: int
    limit: int
    groups: list[dict[str, Any]]  # overview.group_summary rows


class ScalarRow(TypedDict):
    """A rollout's scalar columns, what the groups overview is built from
    (queries.step_groups: never its token arrays or completion)."""

    group: int
    index: int
    vote: str | None
    target: str | None
    verifier_reward: float
    true_score: float | None
    advantage: float
    sum_logprob: float | None
    format_valid: bool | None
    format_state: str | None
    prompt_id: int
    facts_id: int | None


class GroupHeader(TypedDict):
    """What a group's rollouts say about the group (group_header.group_header): prompt, query,
    target, vote histograms, agreement, correct count, supervision."""

    group: int
    prompt: str
    query: Any
    target: str | None
    target_listed: Any
    hint: str | None
    hint_shown_to: list[int]
    tool_count: int
    votes: list[dict[str, Any]]
    vote_kind: str | None
    first_calls: list[dict[str, Any]]
    answers: list[dict[str, Any]]
    agree: int
    size: int
    correct: int
    supervised: dict[str, int]


# --- compare ------------------------------------------------------------------------------------


class BucketSummary(TypedDict):
    """A run's summary from its 25-step buckets and its summary columns (chart_data.run_summary)."""

    run_id: int
    name: str
    steps: int
    converged_at: int | None  # analysis.converged_at
    stability: float | None  # spread of the bucket accuracies from there on
    final_accuracy: float | None  # the last 25 steps
    final_reward: float | None
    device_minutes: float
    cost: float


class RunSummary(BucketSummary):
    """Compare's summary row of one run: with its last evaluations."""

    final_eval: dict[str, Any]  # eval series → {step, value} or None
    final_format_free: float | None


class ConfigDiffRow(TypedDict):
    key: str
    values: list[str]  # one a run, as JSON text ("—": not set)
    differs: list[bool]  # from the first run's


class ConfigDiff(TypedDict):
    rows: list[ConfigDiffRow]  # settings that differ
    same: int  # how many do not
