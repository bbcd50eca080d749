"""Plain data handed from a trainer to the store: one step and its rollouts."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
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


_ARRAY_FIELDS = frozenset(
    {"completion_ids", "token_logprobs", "generator_logprobs", "control_probs"}
)
Ids = np.ndarray  # int64, one a completion position
Floats = np.ndarray  # float64
NO_IDS: Ids = np.zeros(0, dtype=np.int64)
NO_FLOATS: Floats = np.zeros(0)


def as_floats(values: Any) -> Floats:
    """A row of numbers as float64 (an array as it is; None or a non-number: NaN)."""
    if isinstance(values, np.ndarray):
        return values.astype(np.float64, copy=False).reshape(-1)
    try:
        return np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return np.asarray(
            [float(x) if isinstance(x, int | float) else math.nan for x in values], np.float64
        )


class ControlProbs(Mapping[str, Floats]):
    """A rollout's control-token probabilities in the one orientation: `array` is
    [position × token] float64, a column per token of `tokens`, as many rows as the completion
    has positions, or none when they were not measured. As a mapping: token → its column."""

    __slots__ = ("array", "tokens")

    def __init__(self, tokens: Sequence[str], array: np.ndarray) -> None:
        self.tokens = tuple(tokens)
        self.array = array

    @classmethod
    def of(cls, given: Any, length: int, tokens: Sequence[str] | None = None) -> ControlProbs:
        """`given` as ControlProbs, `length` positions: token → row (a mapping, or rows in the
        order of `tokens`: each cut or padded with 0.0 to `length`, as the store has always
        read them), or a [position × token] array. No row has a value: not measured."""
        if isinstance(given, ControlProbs):
            return given
        if isinstance(given, np.ndarray) and given.ndim == 2:
            names = list(tokens or ())
            values = given.astype(np.float64, copy=False)
            if values.shape[0] and values.shape[0] != length:
                fitted = np.zeros((length, values.shape[1]))
                n = min(length, values.shape[0])
                fitted[:n] = values[:n]
                values = fitted
            return cls(names, values)
        if given is None:
            given = {}
        if isinstance(given, Mapping):
            names, rows = list(given), [as_floats(r) for r in given.values()]
        else:
            names, rows = list(tokens or ()), [as_floats(r) for r in given]
            names = names[: len(rows)]
            rows = rows[: len(names)]
        if not any(len(r) for r in rows):
            return cls(names, np.zeros((0, len(names))))
        values = np.zeros((length, len(names)))
        for k, row in enumerate(rows):
            n = min(length, len(row))
            values[:n, k] = row[:n]
        return cls(names, values)

    @property
    def measured(self) -> bool:
        return bool(self.array.shape[0])

    def ordered(self, tokens: Sequence[str]) -> np.ndarray:
        """The [position × token] array with a column per token of `tokens` (a run's order):
        this one's own array when its tokens are those; a token it does not have is a column
        of 0.0 (as the store has always written it)."""
        wanted = tuple(tokens)
        if wanted == self.tokens:
            return self.array
        out = np.zeros((self.array.shape[0], len(wanted)))
        for k, token in enumerate(wanted):
            if token in self.tokens:
                out[:, k] = self.array[:, self.tokens.index(token)]
        return out

    def __getitem__(self, token: str) -> Floats:
        try:
            column: Floats = self.array[:, self.tokens.index(token)]
            return column
        except ValueError:
            raise KeyError(token) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"ControlProbs({self.tokens}, {self.array.shape[0]} positions)"


@dataclass
class RolloutRecord:
    """One completion of a group, as the update saw it: the one typed rollout from the capture
    (or an import's reader) to the store. Its per-token data are numpy arrays whatever they are
    given as: ids (int64), logprobs (float64, none when not measured), the generator's logprobs
    of the same tokens (float64; None: the generation path gave none, NaN inside: a token it
    gave none for) and control-token probabilities (ControlProbs: [position × token])."""

    group: int
    index: int
    prompt: str
    completion: str
    completion_ids: Ids
    token_logprobs: Floats
    # control token → probability at each completion position (same length as completion_ids)
    control_probs: ControlProbs
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
    # The generator's (vLLM's, a rollout function's) logprobs of the completion tokens, beside
    # the trainer's token_logprobs: None where the generation path gave none (never zeros).
    generator_logprobs: Floats | None = None
    # Σ logprob where it is not the sum of token_logprobs: an export's stored sum (its float16
    # logprobs need not add up to it exactly), a recorder's over the wire (at full precision:
    # its logprobs arrive quantized), NaN where it is unknown (a rollout known only as text).
    # None: summed from token_logprobs (sum_logprob).
    given_sum_logprob: float | None = None
    # How the completion's text is rebuilt from its tokens' pieces (arrays.text_rule), where a
    # sender said so and sent no text; None: the text is the completion's own.
    text_rule: int | None = None

    @classmethod
    def captured(
        cls,
        *,
        completion_ids: Ids,
        token_logprobs: Floats,
        control_probs: ControlProbs,
        verifier_reward: float,
        advantage: float,
        generator_logprobs: Floats | None = None,
    ) -> RolloutRecord:
        """A rollout as a trainer's capture first has it (trainer/recorder/captured.py builds it
        from the host copies of TRL's tensors, on the writer's thread): its arrays (int64 ids,
        float64 logprobs — the trainer's and the generator's, None: none — and ControlProbs,
        taken as they are), its reward and advantage; its place in the step, texts and
        judgement are set later (each checked as it is set)."""
        record = cls.__new__(cls)
        record.__dict__.update(
            group=0,
            index=0,
            prompt="",
            completion="",
            completion_ids=completion_ids.astype(np.int64, copy=False).reshape(-1),
            token_logprobs=as_floats(token_logprobs),
            control_probs=control_probs,
            vote=None,
            target=None,
            verifier_reward=verifier_reward,
            true_score=None,
            advantage=advantage,
            format_valid=None,
            format_state=None,
            meta={},
            tokens=None,
            generator_logprobs=generator_logprobs,
            given_sum_logprob=None,
            text_rule=None,
        )
        return record

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ARRAY_FIELDS:
            value = self._array(name, value)
        elif name in _TEXT_FIELDS and isinstance(value, str):
            value = storable(value)
            if name in _LABEL_FIELDS and len(value) > LABEL_CHARS:
                value = value[: LABEL_CHARS - 1] + "…"
        elif name in _JSON_FIELDS:
            value = storable_value(value)
        object.__setattr__(self, name, value)

    def _array(self, name: str, value: Any) -> Any:
        if name == "completion_ids":
            if isinstance(value, np.ndarray) and value.dtype == np.int64:
                return value.reshape(-1)
            return np.asarray(value if len(value) else [], dtype=np.int64).reshape(-1)
        if name == "token_logprobs":
            return as_floats(value)
        if name == "generator_logprobs":
            return None if value is None else as_floats(value)
        return ControlProbs.of(value, len(self.__dict__.get("completion_ids", ())))

    def set_storable_tokens(self, pieces: list[str]) -> None:
        """Its tokens' texts, each made storable already (the wire checks every piece as it
        reads it): not scanned again position by position."""
        object.__setattr__(self, "tokens", pieces)

    @property
    def sum_logprob(self) -> float | None:
        """Σ logprob of the completion: the one given (given_sum_logprob) or its tokens'
        logprobs summed; None when they were not measured (a generation path without them),
        never a 0.0 that reads as certainty."""
        if self.given_sum_logprob is not None:
            return self.given_sum_logprob
        logprobs = self.token_logprobs
        if not len(logprobs) and len(self.completion_ids):
            return None
        # a running sum: the float sum() of the list gives (np.sum adds pairwise)
        return float(np.cumsum(logprobs)[-1]) if len(logprobs) else 0.0


@dataclass
class StepRecord:
    """One optimizer step: its scalar metrics, the rollouts it trained on, and extra series."""

    step: int
    rollout_step: int
    values: dict[str, float | None]  # keys from server.core.vocab.STEP_SERIES
    rollouts: list[RolloutRecord] = field(default_factory=list)  # empty when reusing rollouts
    metrics: dict[str, float | None] = field(default_factory=dict)
    recorded_at: datetime | None = None  # when it was first recorded (an import keeps it); now
