"""Pure per-group and per-step statistics of rollouts (no torch)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence


def vote_agreement(votes: Sequence[str | None]) -> float:
    """Share of the group voting for the modal id (malformed votes never agree)."""
    counts = Counter(v for v in votes if v is not None)
    return max(counts.values()) / len(votes) if counts else 0.0


def vote_entropy(votes: Sequence[str | None]) -> float:
    """Entropy in bits of the group's votes; a malformed vote is its own outcome."""
    counts = Counter(votes)
    n = len(votes)
    return -sum(c / n * math.log2(c / n) for c in counts.values()) if n else 0.0


def is_zero_std(rewards: Sequence[float]) -> bool:
    """Whether every rollout of a group got the same reward (so its advantages are all zero)."""
    return max(rewards) - min(rewards) < 1e-9 if rewards else True


def no_spread(rewards: Sequence[float], top: float = 1.0) -> str | None:
    """A group with no reward spread: "solved" (every reward at the top), "stuck" (all equal
    below it); None for a group with spread."""
    if not is_zero_std(rewards):
        return None
    return "solved" if rewards and min(rewards) >= top - 1e-9 else "stuck"


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, None for no values."""
    return sum(values) / len(values) if values else None


def groups(items: Sequence, group_size: int) -> list[Sequence]:
    """Split rows in group order (G consecutive rows per prompt) into groups."""
    if len(items) % group_size:
        raise ValueError(f"{len(items)} rows do not split into groups of {group_size}")
    return [items[i : i + group_size] for i in range(0, len(items), group_size)]
