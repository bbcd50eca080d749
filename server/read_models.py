"""The named shapes of what the dashboard reads: typed read models (TypedDicts, so the JSON API
sends them as they are) built by serialize, views and queries, and read by the templates, the
JSON API and the Python client.

Pure typing: no session, no SQL, no torch; the client imports this module for the names of a
rollout's keys.
"""

from __future__ import annotations

from typing import Any

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
    tokens: list[str] | None  # each id's text, when every id has one
    tokens_kept: bool  # False: retention dropped the logprobs and control probabilities
    vote: str | None
    target: str | None
    verifier_reward: float
    true_score: float | None
    advantage: float
    sum_logprob: float | None
    format_valid: bool
    format_state: str | None
    token_logprobs: list[float]
    control_token_probs: dict[str, list[float]]
    meta: dict[str, Any]


class RolloutWindow(RolloutData, total=False):
    """A rollout cut to a page's first `max_tokens` positions."""

    tokens_total: int  # positions the rollout has in all


ROLLOUT_KEYS: tuple[str, ...] = tuple(RolloutData.__annotations__)
