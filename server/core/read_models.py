"""The named shapes of what the dashboard reads: typed read models built by serialize and the
queries, read by the views, the templates, the JSON API and the Python client.

TypedDicts: at run time they are the plain dicts the JSON API sends as they are (no copy, no
change of a byte), and mypy checks every key each side names. The four the pages are built on:
the run card (RunData), a run's live state (LiveState), a step in detail (StepHead and its
StepGroups, GroupDetail, StepCard) and compare (CompareData).

Pure typing: no session, no SQL, no torch; the client imports this module for the names of a
rollout's keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NotRequired

import numpy as np
from rollout_lens.server.core.records import ControlProbs, Floats, Ids
from typing_extensions import TypedDict


class RolloutData(TypedDict):
    """One rollout with its per-token arrays decoded (serialize.rollout_dict): what the JSONL
    export writes and the step API sends (the viewer adds its own view fields beside these)."""

    run_id: int
    step: int
    group: int
    index: int
    prompt: str
    completion: str
    completion_ids: list[int]
    # each id's text as decoded (server.core.tokentext), when every id has a piece
    tokens: list[str] | None
    token_pieces: list[str] | None  # each id's raw piece as the tokenizer names it ('Ġcan')
    tokens_kept: bool  # False: retention dropped the logprobs and control probabilities
    vote: str | None
    target: str | None
    verifier_reward: float
    true_score: float | None
    advantage: float
    sum_logprob: float | None
    format_valid: bool | None  # None: nothing judged it
    format_state: str | None
    token_logprobs: list[float]
    control_token_probs: dict[str, list[float]]
    meta: dict[str, Any]


class RolloutWindow(RolloutData, total=False):
    """A rollout cut to a page's first `max_tokens` positions."""

    tokens_total: int  # positions the rollout has in all


ROLLOUT_KEYS: tuple[str, ...] = tuple(RolloutData.__annotations__)


@dataclass(frozen=True, slots=True)
class RolloutView:
    """One stored rollout as the read side returns it (serialize.read_rollout): the step
    entity's per-token data decoded into arrays — ids (int64), logprobs (float64, none when not
    measured or retention dropped them) and control-token probabilities (records.ControlProbs,
    [position × token]) — cut to a page's first positions when read as a window. The step
    viewer renders it as it is; `data()` is its JSON (RolloutData, the export's and the API's
    keys, in their order)."""

    run_id: int
    step: int
    group: int
    index: int
    prompt: str
    completion: str
    completion_ids: Ids
    tokens: list[str] | None  # each id's text as decoded (tokentext), when every id has a piece
    token_pieces: list[str] | None  # each id's raw piece ('Ġcan')
    tokens_kept: bool  # False: retention dropped the logprobs and control-token probabilities
    vote: str | None
    target: str | None
    verifier_reward: float
    true_score: float | None
    advantage: float
    sum_logprob: float | None  # the stored sum, from full precision
    format_valid: bool | None
    format_state: str | None
    token_logprobs: Floats
    control_token_probs: ControlProbs
    meta: dict[str, Any]
    tokens_total: int  # positions the rollout has in all (more than the arrays hold: a window)
    window: bool  # read cut to a page's first positions: its JSON says tokens_total

    def data(self) -> RolloutWindow:
        """The rollout as JSON-ready lists (RolloutData; tokens_total too for a window)."""
        out: RolloutWindow = {
            "run_id": self.run_id,
            "step": self.step,
            "group": self.group,
            "index": self.index,
            "prompt": self.prompt,
            "completion": self.completion,
            "completion_ids": self.completion_ids.tolist(),
            "tokens": self.tokens,
            "token_pieces": self.token_pieces,
            "tokens_kept": self.tokens_kept,
            "vote": self.vote,
            "target": self.target,
            "verifier_reward": self.verifier_reward,
            "true_score": self.true_score,
            "advantage": self.advantage,
            "sum_logprob": self.sum_logprob,
            "format_valid": self.format_valid,
            "format_state": self.format_state,
            "token_logprobs": self.token_logprobs.tolist(),
            "control_token_probs": control_lists(self.control_token_probs),
            "meta": self.meta,
        }
        if self.window:
            out["tokens_total"] = self.tokens_total
        return out

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> RolloutView:
        """A rollout's JSON (RolloutData, as the API sends it) as the typed view; a key it
        lacks reads as nothing recorded (0, None, empty)."""
        ids = np.asarray(data.get("completion_ids") or [], dtype=np.int64)
        control = data.get("control_token_probs") or {}
        return cls(
            run_id=int(data.get("run_id", 0)),
            step=int(data.get("step", 0)),
            group=int(data.get("group", 0)),
            index=int(data.get("index", 0)),
            prompt=str(data.get("prompt", "")),
            completion=str(data.get("completion", "")),
            completion_ids=ids,
            tokens=data.get("tokens"),
            token_pieces=data.get("token_pieces"),
            tokens_kept=bool(data.get("tokens_kept", True)),
            vote=data.get("vote"),
            target=data.get("target"),
            verifier_reward=float(data.get("verifier_reward", 0.0)),
            true_score=data.get("true_score"),
            advantage=float(data.get("advantage", 0.0)),
            sum_logprob=data.get("sum_logprob"),
            format_valid=data.get("format_valid"),
            format_state=data.get("format_state"),
            token_logprobs=np.asarray(data.get("token_logprobs") or [], dtype=np.float64),
            control_token_probs=ControlProbs.of(control, len(ids)),
            meta=dict(data.get("meta") or {}),
            tokens_total=int(data.get("tokens_total", len(ids))),
            window="tokens_total" in data,
        )


def control_lists(control: ControlProbs) -> dict[str, list[float]]:
    """Control-token probabilities as JSON: token → its probability at each position."""
    return {token: control.array[:, k].tolist() for k, token in enumerate(control.tokens)}


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
    groups: list[dict[str, Any]]  # stepview.group_summary rows


class GroupHeader(TypedDict):
    """What a group's rollouts say about the group (stepview.group_header): prompt, query,
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


class GroupDetail(StepHead):
    """One group of a step with a page of its rollouts (queries.group_detail)."""

    group_nav: GroupNav
    summary: dict[str, Any]  # stepview.group_summary
    header: GroupHeader | None
    rollouts_total: int
    offset: int
    rollouts: list[RolloutView]


class MissingGroupCard(StepHead):
    """Compare's step card for a step without the group asked for (queries.step_card)."""

    group_nav: GroupNav
    header: None
    asked_group: int
    rollouts: list[RolloutView]  # none
    rollouts_total: int


StepCard = GroupDetail | MissingGroupCard


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


class CompareSide(TypedDict):
    """One of the first two runs at the side-by-side step."""

    run_id: int
    last_step: int | None
    detail: StepCard | None  # None: the run has no such step


class CompareData(TypedDict):
    """Two or more runs side by side (queries.compare)."""

    runs: list[RunData]
    series: dict[str, Any]  # run id → {bucket, series}: what fills compare's charts
    points: int  # points per chart each run got
    bands: bool  # min–max bands drawn (few runs)
    method: str
    summary: list[RunSummary]
    config_diff: ConfigDiff
    step: int  # the side-by-side step
    group: int
    max_step: int
    side_by_side: list[CompareSide]
