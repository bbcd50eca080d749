"""Plain data handed from a trainer to the store: one step and its rollouts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
from rollout_lens.server.core.textsafe import storable, storable_value

# Verifier and truth disagree: the verifier passed (reward ≥ DISAGREE_AT) a rollout whose true
# score is 0, or failed (reward < DISAGREE_AT) one whose true score is 1. The one definition:
# the step viewer flags it, the recorder stores it (rollouts.disagree) for the explorer's filter.
DISAGREE_AT = 0.5


def disagrees(verifier_reward: float | None, true_score: float | None) -> bool:
    """Whether the verifier's reward and the true score disagree (DISAGREE_AT); False when
    either is unknown or not finite."""
    if verifier_reward is None or true_score is None:
        return False
    if not (math.isfinite(verifier_reward) and math.isfinite(true_score)):
        return False
    passed = verifier_reward >= DISAGREE_AT
    return (passed and true_score == 0) or (not passed and true_score >= 1)


# RolloutRecord's text fields: made storable whenever they are set (server.core.textsafe); the store
# writes meta and token texts as JSON itself, past the engine's serializer.
_TEXT_FIELDS = frozenset({"prompt", "completion", "vote", "target", "format_state"})
_JSON_FIELDS = frozenset({"meta", "tokens"})
# A vote or target is a label the explorer filters on and a histogram counts, not a text: one
# longer than this (a final answer written out, a user's function) is kept to this many characters.
LABEL_CHARS = 256
_LABEL_FIELDS = frozenset({"vote", "target"})


@dataclass
class RolloutRecord:
    """One completion of a group, as the update saw it."""

    group: int
    index: int
    prompt: str
    completion: str
    completion_ids: list[int]
    token_logprobs: list[float]
    # control token → probability at each completion position (same length as completion_ids)
    control_probs: dict[str, list[float]]
    vote: str | None
    target: str | None
    verifier_reward: float
    true_score: float | None
    advantage: float
    format_valid: bool | None  # None: nothing judged it (no format_valid function)
    format_state: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # Each completion token's text (tokenizer.convert_ids_to_tokens), stored once per run and id.
    tokens: list[str] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _TEXT_FIELDS and isinstance(value, str):
            value = storable(value)
            if name in _LABEL_FIELDS and len(value) > LABEL_CHARS:
                value = value[: LABEL_CHARS - 1] + "…"
        elif name in _JSON_FIELDS:
            value = storable_value(value)
        object.__setattr__(self, name, value)

    @property
    def sum_logprob(self) -> float | None:
        """Σ logprob of the completion; None when its tokens' logprobs were not measured (a
        generation path without them), never a 0.0 that reads as certainty."""
        logprobs = self.token_logprobs
        if not len(logprobs) and len(self.completion_ids):
            return None
        if isinstance(logprobs, np.ndarray):  # a running sum: the same float as sum() of a list
            return float(np.cumsum(logprobs, dtype=np.float64)[-1]) if len(logprobs) else 0.0
        return float(sum(logprobs))


@dataclass
class StepRecord:
    """One optimizer step: its scalar metrics, the rollouts it trained on, and extra series."""

    step: int
    rollout_step: int
    values: dict[str, float | None]  # keys from server.core.vocab.STEP_SERIES
    rollouts: list[RolloutRecord] = field(default_factory=list)  # empty when reusing rollouts
    metrics: dict[str, float | None] = field(default_factory=dict)
    recorded_at: datetime | None = None  # when it was first recorded (an import keeps it); now
