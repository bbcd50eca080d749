"""Training–inference mismatch: the trainer's and the generator's logprobs of the same sampled
tokens, compared (pure: arrays in, figures out).

r = p_trainer / p_generator per sampled token, log r = trainer logprob − generator logprob.
A token counts where the mask keeps it (completion tokens the model sampled: tool results are
masked out, as TRL masks them with `tool_mask`) and both sides gave a finite logprob; a
generator logprob that is NaN (vLLM sends None where it has none) is left out, never read as 0.
The figures follow TRL's where TRL has one (trl/trainer/grpo_trainer.py, 1.16.0, lines
2660–2674 and 2860–2895): |Δlogp| over the kept tokens, and the sequence ratio
exp(Σ log r) over a rollout's kept tokens; the shares outside the bands are token-level. One
difference: a rollout with no token to compare has no sequence ratio here (it is left out of
min/mean/max), where TRL's is exp(0) = 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

ABS_DIFF_MEAN = "mismatch/abs_diff_mean"
ABS_DIFF_MAX = "mismatch/abs_diff_max"
K3_KL = "mismatch/k3_kl"
SEQ_RATIO_MIN = "mismatch/seq_ratio_min"
SEQ_RATIO_MEAN = "mismatch/seq_ratio_mean"
SEQ_RATIO_MAX = "mismatch/seq_ratio_max"
OUTSIDE_2X = "mismatch/outside_2x"
OUTSIDE_5X = "mismatch/outside_5x"
NAMES = (
    ABS_DIFF_MEAN,
    ABS_DIFF_MAX,
    K3_KL,
    SEQ_RATIO_MIN,
    SEQ_RATIO_MEAN,
    SEQ_RATIO_MAX,
    OUTSIDE_2X,
    OUTSIDE_5X,
)
# The truncation/masking bands of token-level TIS and MIS: a ratio outside [1/b, b].
BANDS = (2.0, 5.0)


@dataclass(frozen=True)
class Sides:
    """One rollout's two sides: the trainer's logprobs of its completion tokens, the
    generator's (None: the generation path gave none) and which positions count (None: all)."""

    trainer: np.ndarray
    generator: np.ndarray | Sequence[float | None] | None
    mask: np.ndarray | None = None

    def kept(self) -> np.ndarray:
        """Which positions are compared: kept by the mask, finite on both sides (all False
        without a generator side)."""
        trainer, generator, keep = self.checked()
        kept: np.ndarray = keep & np.isfinite(trainer) & np.isfinite(generator)
        return kept

    def checked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(trainer, generator, mask) as float64, float64 (all NaN without a generator side)
        and bool arrays of one length; ValueError where the sides or the mask differ in it."""
        trainer = self.trainer_floats()
        keep = _mask(self.mask, len(trainer))
        if self.generator is None:
            return trainer, np.full(len(trainer), math.nan), keep
        generator = self.generator_floats()
        if len(generator) != len(trainer):
            raise ValueError(
                f"generator logprobs have {len(generator)} positions, trainer logprobs {len(trainer)}"
            )
        return trainer, generator, keep

    def trainer_floats(self) -> np.ndarray:
        return np.asarray(self.trainer, dtype=np.float64).reshape(-1)

    def generator_floats(self) -> np.ndarray:
        """The generator's logprobs as float64 (None inside: NaN); empty without them."""
        if self.generator is None:
            return np.zeros(0)
        if isinstance(self.generator, np.ndarray):
            return self.generator.astype(np.float64, copy=False).reshape(-1)
        return np.asarray([math.nan if v is None else v for v in self.generator], np.float64)

    def compared(self) -> tuple[np.ndarray, np.ndarray]:
        """(trainer, generator) logprobs at the positions compared, in order."""
        keep = self.kept()
        if not keep.any():
            return np.zeros(0), np.zeros(0)
        return self.trainer_floats()[keep], self.generator_floats()[keep]

    def log_ratios(self) -> np.ndarray:
        """log r at the positions compared, in order (empty without a generator side)."""
        trainer, generator = self.compared()
        log_r: np.ndarray = trainer - generator
        return log_r


def _mask(mask: np.ndarray | None, n: int) -> np.ndarray:
    if mask is None:
        return np.ones(n, dtype=bool)
    keep = np.asarray(mask).reshape(-1)
    if len(keep) != n:
        raise ValueError(f"the mask has {len(keep)} positions, the logprobs {n}")
    return keep.astype(bool)


@dataclass(frozen=True)
class RolloutMismatch:
    """A rollout's figures beside Σ logprob: its largest |Δlogp| and its sequence ratio."""

    tokens: int  # the tokens compared
    abs_diff_max: float
    seq_ratio: float
    log_seq_ratio: float  # Σ log r: finite where the ratio over- or underflows

    @classmethod
    def of(cls, log_ratios: np.ndarray) -> RolloutMismatch | None:
        """From a rollout's log r; None where no token could be compared."""
        return each_rollout(log_ratios, [len(log_ratios)])[0]


def rollout_figures(sides: Sides) -> RolloutMismatch | None:
    """One rollout's figures (None: nothing to compare)."""
    return RolloutMismatch.of(sides.log_ratios())


def each_rollout(
    log_ratios: np.ndarray, counts: Sequence[int] | np.ndarray
) -> list[RolloutMismatch | None]:
    """The figures of each rollout, their log r laid end to end (`counts`: how many each has),
    in a few passes over the step's tokens. Σ log r is numpy's add.reduceat over the rollout's
    segment: the same bits wherever the segment lies (a rollout alone or inside a step's
    tokens), which the write path, migration 0021 and the pages rely on."""
    log_r = np.asarray(log_ratios, dtype=np.float64).reshape(-1)
    sizes = np.asarray(counts, dtype=np.int64).reshape(-1)
    starts = (np.cumsum(sizes) - sizes)[sizes > 0]
    if not len(starts):
        return [None] * len(sizes)
    sums = np.add.reduceat(log_r, starts)
    maxes = np.maximum.reduceat(np.abs(log_r), starts)
    with np.errstate(over="ignore"):  # a sum past ~709 nats is an infinite ratio
        ratios = np.exp(sums)
    found = iter(zip(sums.tolist(), maxes.tolist(), ratios.tolist(), strict=True))
    out: list[RolloutMismatch | None] = []
    for n in sizes.tolist():
        if n:
            total, top, ratio = next(found)
            out.append(RolloutMismatch(n, top, ratio, total))
        else:
            out.append(None)
    return out


@dataclass(frozen=True)
class Pool:
    """Every compared token of some rollouts laid end to end, in rollout and position order:
    the rollout holding it (an index into the rollouts given), its completion position, and
    both sides' logprobs."""

    rollout: np.ndarray  # int64
    position: np.ndarray  # int64
    trainer: np.ndarray
    generator: np.ndarray
    rollouts: int = 0  # how many rollouts were given (some may have no token here)

    def log_ratios(self) -> np.ndarray:
        log_r: np.ndarray = self.trainer - self.generator
        return log_r

    def counts(self) -> np.ndarray:
        """How many compared tokens each rollout given has."""
        found: np.ndarray = np.bincount(self.rollout, minlength=self.rollouts)
        return found


def pool(rollouts: Sequence[Sides]) -> Pool:
    """The compared tokens of `rollouts` (Sides.kept: masked, NaN on either side left out), in
    one pass over all of them."""
    parts = [sides.checked() for sides in rollouts]
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return Pool(empty, empty, np.zeros(0), np.zeros(0), 0)
    lengths = np.fromiter((len(t) for t, _, _ in parts), dtype=np.int64, count=len(parts))
    trainer, generator, keep = (np.concatenate(c) for c in zip(*parts, strict=True))
    kept = keep & np.isfinite(trainer) & np.isfinite(generator)
    owner = np.repeat(np.arange(len(parts), dtype=np.int64), lengths)
    position = np.arange(len(trainer), dtype=np.int64) - np.repeat(
        np.cumsum(lengths) - lengths, lengths
    )
    return Pool(owner[kept], position[kept], trainer[kept], generator[kept], len(parts))


def stored_figures(trainer: np.ndarray, generator: np.ndarray | None) -> RolloutMismatch | None:
    """A stored rollout's figures from its arrays as the store keeps them, where a position
    the generator did not sample (a tool result, a masked one) holds NaN on its side: None
    without a generator side, where the trainer's were not measured (an empty array, or one
    of another length) or where no token could be compared."""
    if generator is None or len(generator) != len(trainer):
        return None
    return rollout_figures(Sides(trainer, generator))


def k3(log_ratios: np.ndarray) -> np.ndarray:
    """k3 = r − 1 − log r per token: an unbiased, never negative estimate of
    KL(generator ‖ trainer) from tokens the generator sampled (Schulman, "Approximating KL
    divergence", 2020)."""
    per_token: np.ndarray = np.expm1(log_ratios) - log_ratios
    return per_token


def outside(log_ratios: np.ndarray, band: float) -> np.ndarray:
    """Whether each token's ratio lies outside [1/band, band]."""
    beyond: np.ndarray = np.abs(log_ratios) > math.log(band)
    return beyond


def step_figures(rollouts: Iterable[Sides]) -> dict[str, float]:
    """A step's figures over its rollouts' compared tokens, pooled (as TRL's are on one
    process); empty where no rollout has a generator side to compare."""
    tokens = pool(list(rollouts))
    return pooled_figures(tokens.log_ratios(), tokens.counts())


def pooled_figures(tokens: np.ndarray, counts: Sequence[int] | np.ndarray) -> dict[str, float]:
    """step_figures over log r already pooled, each rollout's laid end to end (`counts`)."""
    ratios = [r.seq_ratio for r in each_rollout(tokens, counts) if r is not None]
    if not len(tokens):
        return {}
    diff = np.abs(tokens)
    return {
        ABS_DIFF_MEAN: float(np.mean(diff)),
        ABS_DIFF_MAX: float(np.max(diff)),
        K3_KL: float(np.mean(k3(tokens))),
        SEQ_RATIO_MIN: min(ratios),
        SEQ_RATIO_MEAN: float(np.mean(ratios)),
        SEQ_RATIO_MAX: max(ratios),
        OUTSIDE_2X: float(np.mean(outside(tokens, BANDS[0]))),
        OUTSIDE_5X: float(np.mean(outside(tokens, BANDS[1]))),
    }


def pooled(rollouts: Sequence[Sides]) -> np.ndarray:
    """Every compared token's log r of a step (or of a range of steps), in rollout order."""
    return pool(rollouts).log_ratios()
