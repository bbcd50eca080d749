"""The Escalation task as TRL sees it: a dataset of prompts, a reward function and a judge."""

from __future__ import annotations

from typing import Any

from trainer.config import RunConfig
from trainer.envs.escalation import (
    TOOL_COUNT,
    EscalationEnv,
    Example,
    format_valid,
    make_verifier,
    parse_vote,
    true_score,
)
from trainer.grpo import Judgement
from trainer.structure import classify


def id_tokens() -> list[str]:
    """Every tool id: the answer tokens probed at the id position."""
    return [f"tool_{i:02d}" for i in range(TOOL_COUNT)]


def make_env(config: RunConfig) -> EscalationEnv:
    """The env a run trains on."""
    return EscalationEnv(seed=config.seed, variant=config.variant, k=config.k)


def dataset_rows(env: EscalationEnv, config: RunConfig) -> list[dict[str, Any]]:
    """One conversational row per group the run will train on, drawn with the run's seed."""
    n = config.steps * config.prompts_per_step
    return [
        {
            "prompt": [{"role": "user", "content": ex.prompt}],
            "target": ex.target,
            "query": ex.query,
            "tool_ids": list(ex.tool_ids),
            "target_listed": ex.target_listed,
            "hint": ex.hint,
        }
        for ex in env.stream(n, seed=config.seed)
    ]


def make_reward_function(config: RunConfig):  # type: ignore[no-untyped-def]
    """TRL reward function wrapping the configured verifier (its name names the TRL metric)."""
    verifier = make_verifier(config.verifier, p=config.verifier_noise, seed=config.seed)

    def reward(completions, prompts, target, query, tool_ids, target_listed, hint, **_):  # type: ignore[no-untyped-def]
        rows = zip(completions, prompts, target, query, tool_ids, target_listed, hint, strict=True)
        return [
            float(
                verifier(
                    _text(c),
                    Example(
                        query=q,
                        prompt=_text(p),
                        target=t,
                        tool_ids=tuple(ids),
                        target_listed=bool(listed),
                        hint=h,
                    ),
                )
            )
            for c, p, t, q, ids, listed, h in rows
        ]

    reward.__name__ = config.verifier
    return reward


def judge(completion: str, row: dict[str, Any], truncated: bool) -> Judgement:
    """Vote, true score and format state of one Escalation completion."""
    vote = parse_vote(completion)
    return Judgement(
        vote=vote,
        true_score=true_score(vote, row["target"]),
        format_valid=format_valid(completion, row["tool_ids"]),
        format_state=classify(completion, row["tool_ids"], truncated=truncated).value,
    )


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)
