"""The JSON API's response shapes, for the OpenAPI schema and /docs (the routes send the
queries' dicts as they are, so these list the fields a client can rely on and allow more). Where
the read side has a shape (server.core.read_models' TypedDicts, step_views' group and compare,
the read view's RolloutJSON) the model is derived from it: its keys and types, with the
descriptions only this module gives; the others describe what a route assembles itself."""

from __future__ import annotations

from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model
from rollout_lens.server.core.read_models import LiveState, RunData, RunOverviewData, StepGroups
from rollout_lens.server.core.step_views import CompareData, GroupDetail, RolloutJSON


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


def _documented(
    shape: Any, name: str, doc: str, described: dict[str, str], **types: Any
) -> type[BaseModel]:
    """An open model of a read model (a TypedDict): its keys and their types as the read model
    has them, a key it may leave out defaulting to null; `described`: key → its description;
    `types`: the keys documented as another model (or whose read model holds typed views)."""
    hints = get_type_hints(shape)
    fields: dict[str, Any] = {
        key: (
            types.get(key, kind),
            Field(... if key in shape.__required_keys__ else None, description=described.get(key)),
        )
        for key, kind in hints.items()
    }
    fields |= {  # what the route adds to the read model
        key: (kind, Field(..., description=described.get(key)))
        for key, kind in types.items()
        if key not in hints
    }
    model: type[BaseModel] = create_model(name, __base__=_Open, __doc__=doc, **fields)
    return model


Run = _documented(
    RunData,
    "Run",
    "A run's columns: recipe, status, progress and its last-25-step figures.",
    {
        "status": "queued, running, completed, failed, cancelled or lost",
        "source": "launched, callback, trl-import or import",
        "k": "shortlist size of a patched run; null for leaky",
        "recent_true_accuracy": "mean of the last 25 steps",
        "recent_reward": "mean of the last 25 steps",
        "phase": "what a claimed run does before its first step (building its model)",
        "created_at": "ISO 8601, UTC with its zone (+00:00)",
        "started_at": "ISO 8601, UTC with its zone",
        "finished_at": "ISO 8601, UTC with its zone",
        "ended_by": "who ended it: recorder, worker, sweeper (lost: no heartbeat), or "
        "`dashboard (token 1a2b3c4d)` for a cancel; for a launched run still running, who asked "
        "it to stop",
    },
)


class Links(_Open):
    prev: str | None
    next: str | None


RunsPage = create_model(
    "RunsPage",
    __base__=_Open,
    __doc__="One page of runs, newest first unless sorted otherwise.",
    runs=list[Run],  # type: ignore[valid-type]
    total=int,
    page=int,
    per_page=int,
    pages=int,
    links=Links,
)


class Alert(_Open):
    kind: str = Field(description="reward_hacking, collapse, control_token_spike, signal_loss…")
    step: int
    message: str
    severity: str = Field(description="warning or info")
    url: str = Field(description="the step's page")


Progress = _documented(
    LiveState,
    "Progress",
    "A run's live state (what live pages poll).",
    {"summary": "one line: place in the queue, speed and ETA, or its end"},
)
RunOverview = _documented(
    RunOverviewData,
    "RunOverview",
    "A run's card, its first and last recorded steps, its series' names, live state and alerts.",
    {},
    run=Run,
    live=Progress,
    alerts=list[Alert],
)


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


Compare = _documented(
    CompareData,
    "Compare",
    "Two or more runs: their charts' series, summaries, settings that differ, one step side by side.",
    {"side_by_side": "the first two runs at one step: each one's step card, its rollouts as JSON"},
    runs=list[Run],  # type: ignore[valid-type]
    side_by_side=list[dict[str, Any]],
)
Step = _documented(
    StepGroups,
    "Step",
    "A step: its metrics and neighbours and a page of its groups overview (no rollouts).",
    {
        "groups": "one summary a group, a page of them",
        "total": "groups that match (the page's look)",
    },
    run=Run,
)


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


class RolloutFigures(BaseModel):
    """A rollout's training–inference mismatch over all its compared tokens (viewer.mismatch_json:
    the figures its stats row shows beside Σ logprob)."""

    model_config = ConfigDict(json_schema_extra=_null_for_non_finite)

    tokens: int = Field(description="its tokens with a finite logprob on both sides")
    abs_diff_max: float = Field(description="the largest |trainer − generator logprob| of them")
    seq_ratio: float = Field(
        description="the sequence-level importance ratio Π p_trainer / p_generator over them "
        "(null past a float's range)"
    )


class GroupRollout(RolloutJSON):  # type: ignore[misc,valid-type]  # derived from the view
    """A rollout of a group's page: step_views.RolloutJSON (the read view's JSON: what the
    export writes), cut to the page's `max_tokens` positions and text budget, with the
    viewer's marks."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_null_for_non_finite)

    tokens_total: int = Field(description="token positions it has in all (the arrays hold fewer)")
    completion_chars: int = Field(description="characters of its completion (the text may be cut)")
    prompt_chars: int = Field(description="characters of its prompt (the text may be cut)")
    disagree: bool = Field(description="the verifier and the truth disagree")
    sampled: list[bool] | None = Field(
        description="a tool-calling rollout's positions the model sampled (null: every one)"
    )
    mismatch: RolloutFigures | None = Field(
        None,
        description="only where it has the generator's logprobs: its figures over all its "
        "positions, not only those sent (null: no token to compare)",
    )


Group = _documented(
    GroupDetail,
    "Group",
    "One group of a step: its summary and a page of its rollouts with per-token arrays.",
    {
        "prompt_id": "its prompt (its first rollout's): /api/runs/{run_id}/prompts/{prompt_id} is "
        "that prompt's history",
        "rollouts": "a page of rollouts: `tokens` is each token's text as decoded, "
        "`token_pieces` the tokenizer's raw pieces",
        "next": "the next page of rollouts (null at the end)",
    },
    run=Run,
    rollouts=list[GroupRollout],
    limit=int,
    max_tokens=int,
    next=str | None,
)


class Rollouts(_Open):
    """A page of the explorer: a run's rollouts across steps that match the filters."""

    rollouts: list[dict[str, Any]] = Field(description="one row a rollout, with its links")
    total: int = Field(description="rollouts that match, counted up to 100,000")
    total_capped: bool = Field(description="true when more than 100,000 match")
    next: str | None = Field(description="pass as `after` for the next page (null at the end)")
    generator_side: bool = Field(
        description="whether any rollout of the run has generator logprobs to compare: the rows' "
        "abs_diff_max (largest |Δlogp|) and log_seq_ratio (log of the sequence ratio) are null "
        "where not"
    )


class MismatchSteps(_Open):
    """Which steps a drill-down read."""

    read: list[int] = Field(description="the steps read, in order")
    first: int | None = Field(description="the first step read")
    last: int | None = Field(description="the last step read")
    unkept: list[int] = Field(description="steps whose token arrays retention dropped: not read")
    cut: bool = Field(description="true when a range stopped before its end (its bounds)")
    next_from: int | None = Field(description="the first step not read when cut")


class MismatchToken(_Open):
    """A token of largest |log r|, in its rollout."""

    step: int
    group: int
    index: int = Field(description="the rollout's index in its group")
    position: int = Field(description="the token's completion position")
    log_ratio: float = Field(description="log p_trainer − log p_generator")
    trainer_logprob: float
    generator_logprob: float
    token_id: int | None
    token: str | None = Field(description="its text (null where the run kept none)")
    before: str | None = Field(description="the text of up to 4 tokens before it")
    after: str | None = Field(description="the text of up to 4 tokens after it")
    rollout_url: str = Field(description="its rollout in the step viewer")


class MismatchLinks(_Open):
    next: str | None = Field(description="the rest of a range that was cut (null otherwise)")
    page: str = Field(description="this drill-down's page")


class Mismatch(_Open):
    """A step's (or a range's) generator and trainer logprobs compared, token by token."""

    generator_side: bool = Field(description="whether the run recorded generator logprobs")
    steps: MismatchSteps
    rollouts: int = Field(description="rollouts compared")
    tokens: int = Field(description="tokens compared (sampled tokens both sides gave)")
    figures: dict[str, float | None] = Field(
        description="the mismatch/* figures over these tokens (null: past float range)"
    )
    histogram: dict[str, Any] = Field(
        description="counts of log r between `edges` (the bands' edges among them), `below` "
        "and `above` its range, `bands`: the edges ±log 2 and ±log 5"
    )
    by_probability: list[dict[str, Any]] = Field(
        description="a row a bucket of the generator's probability [low, high): tokens, mean "
        "and max |Δlogp|, k3 KL, shares outside ×2 and ×5 (null where empty)"
    )
    worst: list[MismatchToken]
    scatter: dict[str, Any] = Field(
        description="at most 4,000 points (the worst tokens and a fixed-seed sample): "
        "`generator` and `trainer` logprobs, `rollouts` [step, group, index], `worst` (which "
        "points are the worst tokens), `points` of `tokens`"
    )
    links: MismatchLinks


class Launched(_Open):
    runs: list[dict[str, Any]] = Field(description="the queued runs, each with its page's URL")


class Deleted(_Open):
    deleted: int = Field(description="the id of the deleted run")


# --- the prompt lens (server.webapp.queries.prompts; server.core.prompt_rules defines each figure)


class PromptFigures(_Open):
    """What happened to one prompt of a run, its groups taken in (step, group) order."""

    prompt_id: int
    label: str = Field(
        description="what tells it apart: the query its env named, else its last user turn, "
        "else what follows the prefix every prompt of the run shares"
    )
    groups: int
    rollouts: int
    first_step: int
    last_step: int
    reward_mean: float | None
    true_mean: float | None = Field(description="mean true score; null where none is known")
    solved_groups: int = Field(description="groups solved by majority")
    solved_at: int | None = Field(
        description="first step a group of it was solved by majority (more than half of its "
        "rollouts with a true score truly correct)"
    )
    last_solved: int | None
    last_failed: int | None = Field(description="last step a group of it was not solved")
    state: str | None = Field(description="solved or failed: its last known group's")
    flips: int = Field(description="changes between solved and failed, group to group")
    zero_spread_share: float | None = Field(
        description="share of its groups whose rollouts all got the same reward (no gradient)"
    )
    forgotten: bool = Field(description="solved, then failed at a later step")
    votes: dict[str, int] = Field(description="its most frequent votes; `None` is malformed")
    target: str | None


class Prompt(PromptFigures):
    text: str = Field(description="the whole prompt")


class PromptsPage(_Open):
    """One page of a run's prompts: pass `next` back as `after`."""

    run: dict[str, Any]
    prompts: list[Prompt]
    total: int
    next: str | None
    filters: dict[str, Any]


class HeatmapCell(_Open):
    col: int = Field(description="column: steps first_step + col × bucket onwards")
    first_step: int
    last_step: int
    value: float | None = Field(description="true score mean, else reward mean (see score)")
    score: str = Field(description="true or reward: what value is")
    reward_mean: float | None
    true_mean: float | None
    groups: int
    solved: int
    failed: int
    zero_spread: int
    step: int = Field(description="the cell's first group's step (for the step viewer)")
    group: int


class HeatmapRow(_Open):
    prompt_id: int
    label: str
    solved_at: int | None
    flips: int
    cells: list[HeatmapCell]


class PromptHeatmap(_Open):
    """Prompts × steps (or buckets of `bucket` steps): a page of the prompts list's rows."""

    run: dict[str, Any]
    first_step: int | None
    last_step: int | None
    bucket: int
    columns: int
    rows: list[HeatmapRow]
    total: int
    next: str | None


class PromptGroup(_Open):
    """One group of the prompt: its figures and its rollouts' values in index order."""

    step: int
    group: int
    size: int
    reward_mean: float | None
    reward_min: float | None
    reward_max: float | None
    true_mean: float | None
    correct: int
    solved: bool | None
    zero_spread: bool
    agreement: float | None
    votes: dict[str, int]
    rollout_ids: list[int]
    indexes: list[int]
    rewards: list[float | None]
    true_scores: list[float | None]
    advantages: list[float | None]
    rollout_votes: list[str | None]
    states: list[str | None]
    completions: list[str] | None = Field(
        default=None,
        description="its rollouts' completions (their first 4,000 characters), with "
        "completions=true",
    )


class PromptHistory(_Open):
    """Every group of one prompt of a run, in (step, group) order: pass `next` as `after`."""

    run: dict[str, Any]
    prompt: Prompt
    steps: list[PromptGroup]
    next: str | None


class PromptInRun(_Open):
    run_id: int
    prompts: list[PromptFigures]


class MatchedPrompt(_Open):
    key: str
    label: str
    runs: list[PromptInRun]


class ComparePrompts(_Open):
    """The runs' prompts matched across them, by label: pass `next` as `after`."""

    runs: list[dict[str, Any]]
    match: str
    prompts: list[MatchedPrompt]
    total: int
    next: str | None
