"""The training rewards of both envs: one registry of names and one way each is built.

The names are server.core.task_vocab's `VerifierName` (the web app offers and validates them without
the trainer); `make` builds each from how an env scores a rollout (`Scoring`), and mypy checks
that every name has a case (`assert_never`). What truly differs between the envs is the scoring:
single-turn reads the id a reply names (trainer.envs.onestep), multi-turn the facts of a
conversation (trainer.envs.multistep).

    exact   the true score: 1.0 for the right reply, else 0.0
    format  exact, and partial credit for a plausible wrong reply (hackable on purpose, so reward
            can drift from truth)
    noisy   exact, flipped with probability p
    judge   format, missing a right reply with probability p (fooled, and it misses)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, ParamSpec, TypeGuard, assert_never

from rollout_lens.server.core.task_vocab import VERIFIERS, VerifierName

FORMAT_PARTIAL_CREDIT = 0.5

P = ParamSpec("P")  # what an env's verifier reads: (completion, example) or (facts, answer)


@dataclass(frozen=True)
class Scoring(Generic[P]):
    """How an env scores one rollout against its truth."""

    true_score: Callable[P, float]  # 1.0 when right, else 0.0
    plausible: Callable[P, bool]  # a wrong reply a format-checking verifier still credits


def _is_name(name: str) -> TypeGuard[VerifierName]:
    return name in VERIFIERS


def make(name: str, scoring: Scoring[P], *, p: float = 0.1, seed: int = 0) -> Callable[P, float]:
    """The verifier `name` over an env's scoring; `p` and `seed` only matter to noisy and judge
    (each draws from a random stream of its own, so noise does not shift the env's draws)."""
    if not _is_name(name):
        raise ValueError(f"unknown verifier {name!r}; valid names: {', '.join(sorted(VERIFIERS))}")
    match name:
        case "exact":
            return scoring.true_score
        case "format":
            return _format(scoring)
        case "noisy":
            return _noisy(scoring, p=p, seed=seed)
        case "judge":
            return missing(_format(scoring), p=p, seed=seed, name="judge")
        case _:
            assert_never(name)


def _format(scoring: Scoring[P]) -> Callable[P, float]:
    def verify(*args: P.args, **kwargs: P.kwargs) -> float:
        if scoring.true_score(*args, **kwargs) == 1.0:
            return 1.0
        return FORMAT_PARTIAL_CREDIT if scoring.plausible(*args, **kwargs) else 0.0

    return verify


def _noisy(scoring: Scoring[P], *, p: float, seed: int) -> Callable[P, float]:
    _check_p(p, "noisy")
    rng = random.Random(seed)

    def verify(*args: P.args, **kwargs: P.kwargs) -> float:
        score = scoring.true_score(*args, **kwargs)
        return 1.0 - score if rng.random() < p else score

    return verify


def missing(verify: Callable[P, float], *, p: float, seed: int, name: str) -> Callable[P, float]:
    """`verify`, missing a reply it gives full credit with probability `p` (scored 0.0 then),
    from a random stream of its own so it does not shift the env's draws."""
    _check_p(p, name)
    rng = random.Random(seed)

    def fallible(*args: P.args, **kwargs: P.kwargs) -> float:
        score = verify(*args, **kwargs)
        return 0.0 if score == 1.0 and rng.random() < p else score

    return fallible


def _check_p(p: float, name: str) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} verifier needs 0 <= p <= 1, got {p!r}")
