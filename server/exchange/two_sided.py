"""What the readers of dumps that hold both sides (NeMo-RL's, slime's and miles') share: a
rollout's token arrays checked, the step as the existing import path takes it (a StepRecord)
plus the generator's logprobs beside it, and the step's mismatch figures.

Each rollout's generator logprobs are stored with it (RolloutRecord.generator_logprobs: NaN at
a masked position, a tool or environment result the generator did not sample, as at a token it
gave none for); TwoSidedStep also keeps them unmasked beside the StepRecord with the masks, one
array a rollout in the record's rollout order. The figures computed from them land as the
step's `mismatch/*` series.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rollout_lens.server.core import mismatch
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import ControlProbs, Floats, RolloutRecord, StepRecord
from rollout_lens.server.exchange import bounds

LOGPROB_MAX = 1e-4  # a logprob is at most 0; a kernel's rounding may carry it a hair above


@dataclass(frozen=True)
class Sided:
    """One rollout's completion as a two-sided dump holds it: token ids, the trainer's and the
    generator's logprobs (NaN where the generator gave none) and which positions the model
    sampled (False: a tool or environment result, masked out of the loss)."""

    ids: np.ndarray  # int64
    trainer: Floats
    generator: Floats
    mask: np.ndarray  # bool

    def sides(self) -> mismatch.Sides:
        return mismatch.Sides(self.trainer, self.generator, self.mask)

    def stored_logprobs(self) -> Floats:
        """The trainer's logprobs as the store keeps them: 0.0 where the mask is off (what the
        recorder stores at a tool result's positions)."""
        return np.where(self.mask, self.trainer, 0.0)

    def stored_generator(self) -> Floats:
        """The generator's logprobs as the store keeps them: NaN where the mask is off (no
        sampled token to compare there), so that the stored arrays compare as the dump does."""
        return np.where(self.mask, self.generator, math.nan)


@dataclass
class TwoSidedStep:
    """A step of a two-sided dump: the StepRecord the import path writes, and per rollout (in
    `record.rollouts` order) its generator logprobs and mask."""

    record: StepRecord
    generator_logprobs: list[Floats]
    masks: list[np.ndarray]


def integers(values: Any, where: str, what: str) -> np.ndarray:
    """A list of token ids (0 to MAX_INT32) as int64; InvalidInput naming `where` otherwise."""
    if not isinstance(values, list) or len(values) > bounds.MAX_TOKENS:
        raise InvalidInput(f"{where}: {what} is not a list of at most {bounds.MAX_TOKENS:,} ids")
    if not all(type(v) is int and 0 <= v <= bounds.MAX_INT32 for v in values):
        raise InvalidInput(f"{where}: {what} holds a value that is not a token id")
    return np.asarray(values, dtype=np.int64)


def floats(values: Any, where: str, what: str, *, missing: bool) -> Floats:
    """A list of logprobs as float64. Where `missing` (the generator's side) None, NaN and ±inf
    are NaN: no logprob given (vLLM sends None), left out of every figure; elsewhere they are
    refused, as is a number above LOGPROB_MAX."""
    if not isinstance(values, list) or len(values) > bounds.MAX_TOKENS:
        raise InvalidInput(
            f"{where}: {what} is not a list of at most {bounds.MAX_TOKENS:,} numbers"
        )
    out = np.empty(len(values))
    for i, v in enumerate(values):
        number = type(v) in (int, float)
        if number and math.isfinite(v) and v <= LOGPROB_MAX:
            out[i] = v
        elif missing and (v is None or number and not math.isfinite(v)):
            out[i] = math.nan
        else:
            raise InvalidInput(f"{where}: {what}[{i}] is {v!r}, not a logprob")
    return out


def flags(values: Any, where: str, what: str) -> np.ndarray:
    """A 0/1 mask as bool; InvalidInput for anything else."""
    if not isinstance(values, list) or not all(
        v in (0, 1) and type(v) in (int, bool) for v in values
    ):
        raise InvalidInput(f"{where}: {what} is not a list of 0s and 1s")
    return np.asarray(values, dtype=bool)


def same_length(where: str, **arrays: np.ndarray) -> int:
    """The arrays' common length; InvalidInput naming each length where they differ (ragged)."""
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{name} {n}" for name, n in lengths.items())
        raise InvalidInput(f"{where}: the per-token arrays differ in length ({shown})")
    return next(iter(lengths.values()), 0)


def token_rollout(sided: Sided, **fields: Any) -> RolloutRecord:
    """A rollout with its token ids and both sides' logprobs (no control-token probabilities:
    no dump holds them), its format unchecked."""
    return RolloutRecord(
        completion_ids=sided.ids,
        token_logprobs=sided.stored_logprobs(),
        generator_logprobs=sided.stored_generator(),
        control_probs=ControlProbs.of(None, len(sided.ids)),
        vote=None,
        format_valid=True,
        format_state="unchecked",
        **fields,
    )


def step_metrics(sided: Sequence[Sided]) -> dict[str, float | None]:
    """The step's mismatch figures (none where no token could be compared)."""
    return dict(mismatch.step_figures([s.sides() for s in sided]))
