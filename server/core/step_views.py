"""A step in detail as the read side returns it: a stored rollout's typed view (RolloutView:
its per-token data decoded into arrays, read_models.Rollout's fields) and the shapes that hold
views (a group of a step, compare's side-by-side step). The step viewer renders these as they
are; their JSON is `RolloutView.data()` (read_models.Rollout's keys).

Apart from read_models (plain JSON shapes, which the client imports without numpy or the
entity) because a view holds the entity's arrays (records.ControlProbs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from rollout_lens.server.core.read_models import (
    ROLLOUT_KEYS,
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
class RolloutView:
    """One stored rollout as the read side returns it (serialize.read_rollout): the step
    entity's per-token data decoded into arrays — ids (int64), logprobs (float64, none when not
    measured or retention dropped them) and control-token probabilities (records.ControlProbs,
    [position × token]) — cut to a page's first positions when read as a window. The step
    viewer renders it as it is; `data()` is its JSON (read_models.Rollout: the export's and the API's
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

    def data(self) -> dict[str, Any]:
        """The rollout as JSON-ready values, its keys those of the one description (Rollout),
        in its order; a window adds tokens_total."""
        out = {name: _json(getattr(self, name)) for name in ROLLOUT_KEYS}
        if self.window:
            out["tokens_total"] = self.tokens_total
        return out

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> RolloutView:
        """A rollout's JSON (read_models.Rollout's keys, as the API sends it) as the typed view; a key it
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


# The view holds every field of the one description (its per-token ones as arrays).
if missing := set(ROLLOUT_KEYS) - set(RolloutView.__dataclass_fields__):
    raise TypeError(f"RolloutView lacks {sorted(missing)} of read_models.Rollout")


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
    summary: dict[str, Any]  # stepview.group_summary
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
