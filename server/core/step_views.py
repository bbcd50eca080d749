"""A step in detail as the read side returns it: a stored rollout's typed view (RolloutView:
its per-token data decoded into arrays, and the one description of a rollout's fields) and the
shapes that hold views (a group of a step, compare's side-by-side step). The step viewer
renders these as they are; their JSON is `RolloutView.data()`, its keys ROLLOUT_KEYS and its
JSON model RolloutJSON, both derived from the view's fields.

Apart from read_models (plain JSON shapes of runs and steps, which import nothing of ours)
because a view holds the entity's arrays (records.ControlProbs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, get_type_hints

import numpy as np
from pydantic import BaseModel, Field, create_model
from rollout_lens.server.core.mismatch import RolloutMismatch, stored_figures
from rollout_lens.server.core.read_models import (
    ConfigDiff,
    GroupHeader,
    GroupNav,
    RunData,
    RunSummary,
    StepHead,
)
from rollout_lens.server.core.records import ControlProbs, Floats, Ids
from typing_extensions import TypedDict


@dataclass(frozen=True, slots=True)
class JsonKey:
    """A view field that is a key of the rollout's JSON (its annotation's metadata): what it
    means, its JSON type where the view holds an array (ids, logprobs, control-token
    probabilities), and its value when a file or a client's record lacks it (... : required)."""

    description: str
    json: Any = None
    default: Any = ...


@dataclass(frozen=True, slots=True)
class RolloutView:
    """One stored rollout as the read side returns it (serialize.read_rollout), and the one
    description of a rollout's fields: the step entity's per-token data decoded into arrays —
    ids (int64), logprobs (float64, none when not measured or retention dropped them) and
    control-token probabilities (records.ControlProbs, [position × token]) — cut to a page's
    first positions when read as a window. The step viewer renders it as it is; `data()` is its
    JSON, whose keys (ROLLOUT_KEYS, the client's) and JSON model (RolloutJSON: the export's
    records, the API's models) are derived from the fields marked JsonKey, in their order."""

    run_id: Annotated[int, JsonKey("the run's id in the database that served it")]
    step: Annotated[int, JsonKey("the step whose generation sampled it (its rollout step)")]
    group: Annotated[int, JsonKey("its group: the G rollouts of one prompt")]
    index: Annotated[int, JsonKey("its place in the group, in sampling order")]
    prompt: Annotated[str, JsonKey("what the policy saw, chat template applied")]
    completion: Annotated[str, JsonKey("what the policy sampled")]
    completion_ids: Annotated[Ids, JsonKey("the completion's token ids", list[int])]
    tokens: Annotated[
        list[str] | None,
        JsonKey(
            "each token's text as decoded (server.core.tokentext), when every id has a piece (files "
            "of older versions held the raw pieces here)",
            default=None,
        ),
    ]
    token_pieces: Annotated[
        list[str] | None,
        JsonKey("each token's raw piece as the tokenizer names it ('Ġcan')", default=None),
    ]
    tokens_kept: Annotated[
        bool,
        JsonKey(
            "false: retention dropped its logprobs and control-token probabilities (not in the "
            "export: its arrays say it)",
            default=True,
        ),
    ]
    vote: Annotated[str | None, JsonKey("the tool id (or answer) the completion names")]
    target: Annotated[str | None, JsonKey("the tool id that is right for the query")]
    verifier_reward: Annotated[float, JsonKey("the training reward from the verifier")]
    true_score: Annotated[float | None, JsonKey("1 if the vote is the target, else 0")]
    advantage: Annotated[float, JsonKey("its reward relative to its group's")]
    sum_logprob: Annotated[
        float | None,
        JsonKey("Σ logprob under the sampling policy, from full precision; null: not measured"),
    ]
    format_valid: Annotated[bool | None, JsonKey("null: nothing judged it")]
    format_state: Annotated[str | None, JsonKey("its structural state (vocab.FormatState)")]
    token_logprobs: Annotated[
        Floats,
        JsonKey(
            "log p of each sampled token (empty: not measured, or retention dropped it)",
            list[float],
        ),
    ]
    generator_logprobs: Annotated[
        Floats | None,
        JsonKey(
            "log p of each sampled token under the generator (vLLM's, a rollout function's), "
            "beside token_logprobs; null: the generation path gave none (or retention dropped "
            "it); NaN: a token it gave none for",
            list[float] | None,
            default=None,
        ),
    ]
    control_token_probs: Annotated[
        ControlProbs,
        JsonKey("control token → its probability at each position", dict[str, list[float]]),
    ]
    meta: Annotated[dict[str, Any], JsonKey("what else the recorder kept (probes, turns, row)")]
    # not keys of every rollout's JSON: a window's says tokens_total
    tokens_total: int  # positions the rollout has in all (more than the arrays hold: a window)
    window: bool  # read cut to a page's first positions: its JSON says tokens_total
    # max |Δlogp| and the sequence ratio over all its positions, a window's too (None: no
    # generator side, or no token to compare); the group page's JSON twin sends it
    mismatch: RolloutMismatch | None

    def data(self) -> dict[str, Any]:
        """The rollout as JSON-ready values, its keys ROLLOUT_KEYS in their order; a window
        adds tokens_total."""
        out = {name: _json(getattr(self, name)) for name in ROLLOUT_KEYS}
        if self.window:
            out["tokens_total"] = self.tokens_total
        return out

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> RolloutView:
        """A rollout's JSON (ROLLOUT_KEYS, as the API sends it) as the typed view; a key it lacks
        reads as nothing recorded (0, None, empty)."""
        ids = np.asarray(data.get("completion_ids") or [], dtype=np.int64)
        control = data.get("control_token_probs") or {}
        logprobs = np.asarray(data.get("token_logprobs") or [], dtype=np.float64)
        generator = _floats_or_none(data.get("generator_logprobs"))
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
            token_logprobs=logprobs,
            generator_logprobs=generator,
            control_token_probs=ControlProbs.of(control, len(ids)),
            meta=dict(data.get("meta") or {}),
            tokens_total=int(data.get("tokens_total", len(ids))),
            window="tokens_total" in data,
            mismatch=stored_figures(logprobs, generator),  # from the positions given
        )


def _floats_or_none(values: Any) -> Floats | None:
    """A JSON list of logprobs as float64 (null: NaN); None stays None (none given)."""
    if values is None:
        return None
    return np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)


def _json_keys() -> dict[str, tuple[Any, JsonKey]]:
    """The view's fields that are keys of its JSON, in order: name → (annotation, JsonKey)."""
    hints = get_type_hints(RolloutView, include_extras=True)
    out = {}
    for name, hint in hints.items():
        key = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, JsonKey)), None)
        if key is not None:
            out[name] = (hint.__origin__, key)
    return out


_KEYS = _json_keys()
# The keys of a rollout's JSON, in its order: the export's, the API's, the Python client's.
ROLLOUT_KEYS: tuple[str, ...] = tuple(_KEYS)


def json_types() -> dict[str, Any]:
    """Each key of a rollout's JSON (ROLLOUT_KEYS) → its type there: the view's own, or the
    JSON one of a field the view holds as an array."""
    return {name: key.json or kind for name, (kind, key) in _KEYS.items()}


def _json_model() -> type[BaseModel]:
    """A pydantic model of the rollout's JSON derived from the view's keys (their JSON types,
    descriptions and defaults, in their order)."""
    described: dict[str, Any] = {
        name: (kind, Field(_KEYS[name][1].default, description=_KEYS[name][1].description))
        for name, kind in json_types().items()
    }
    model: type[BaseModel] = create_model("Rollout", **described)
    return model


# The rollout's JSON as a pydantic model, derived from the view: the export's records
# (exchange.schema.RolloutLine) and the API's models (http.api_models.GroupRollout) extend it.
RolloutJSON = _json_model()


def _json(value: Any) -> Any:
    """An array (ids, logprobs) as a list, control-token probabilities by token; else as is."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, ControlProbs):
        return _control_lists(value)
    return value


def _control_lists(control: ControlProbs) -> dict[str, list[float]]:
    """Control-token probabilities as JSON: token → its probability at each position."""
    return {token: control.array[:, k].tolist() for k, token in enumerate(control.tokens)}


# --- a group of a step, compare's side-by-side step -------------------------------------------


class GroupDetail(StepHead):
    """One group of a step with a page of its rollouts (queries.group_detail)."""

    group_nav: GroupNav
    summary: dict[str, Any]  # overview.group_summary
    prompt_id: int  # its first rollout's prompt: the prompt lens's history of it
    header: GroupHeader | None
    rollouts_total: int
    offset: int
    rollouts: list[RolloutView]


class _MissingGroupCard(StepHead):
    """Compare's step card for a step without the group asked for (queries.step_card)."""

    group_nav: GroupNav
    header: None
    asked_group: int
    rollouts: list[RolloutView]  # none
    rollouts_total: int


StepCard = GroupDetail | _MissingGroupCard


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
