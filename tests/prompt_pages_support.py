"""A leaky and a patched run of the product's own task (the Escalation env's prompts, 64 tools
listed against 4), recorded through the store as the trainer writes them: the pair the prompt
lens's compare page matches by query."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord
from rollout_lens.server.store.db import session_scope
from rollout_lens.trainer.envs.onestep import EscalationEnv, Example, reply
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, record_steps, step_record

GROUP = 8
BUCKET = 5  # the leaky run's accuracy swings between buckets of this many steps


def _correct(variant: str, step: int, query: int) -> int:
    """How many of a group's rollouts name the target: the patched run learns in a few steps and
    stays; the leaky run swings between all right and a split vote, bucket by bucket."""
    if variant == "patched":
        return min(GROUP, 2 * step + query % 2)
    return GROUP if ((step - 1) // BUCKET + query) % 2 else 3


def group_rollouts(examples: Sequence[Example], variant: str, step: int) -> list[RolloutRecord]:
    """A step's groups, one an example (the env's prompts, built once for every step)."""
    out = []
    for group, example in enumerate(examples):
        wrong = next(t for t in example.tool_ids if t != example.target)
        right = _correct(variant, step, group)
        votes = [example.target if i < right else wrong for i in range(GROUP)]
        rewards = [float(v == example.target) for v in votes]
        mean = sum(rewards) / GROUP
        for index, vote in enumerate(votes):
            out.append(
                RolloutRecord(
                    group=group,
                    index=index,
                    prompt=example.prompt,
                    completion=reply(vote),
                    completion_ids=[5, 100 + index, 6, 2],
                    token_logprobs=[-0.1, -0.2, -0.1, -0.3],
                    control_probs={t: [0.1, 0.2, 0.1, 0.2] for t in CONTROL_TOKENS},
                    vote=vote,
                    target=example.target,
                    verifier_reward=rewards[index],
                    true_score=rewards[index],
                    advantage=rewards[index] - mean,
                    format_valid=True,
                    format_state="healthy_call",
                    meta={
                        "query": example.query,
                        "tool_ids": list(example.tool_ids),
                        "target_listed": example.target_listed,
                    },
                )
            )
    return out


def escalation_pair(
    factory: sessionmaker[Session], *, steps: int = 12, queries: int | None = None
) -> dict[str, Any]:
    """The leaky and the patched run (same seed, same queries), `steps` steps each, a group a
    training query each step (the env's first `queries` of them, else all); their ids and the
    queries."""
    runs: dict[str, Any] = {}
    for variant in ("leaky", "patched"):
        env = EscalationEnv(seed=0, variant=variant, k=4)
        with session_scope(factory) as session:
            run_id = store.create_run(
                session,
                name=f"{variant} {'64 tools' if variant == 'leaky' else 'k=4'}",
                model="tiny",
                total_steps=steps,
                group_size=GROUP,
                variant=variant,
                k=None if variant == "leaky" else 4,
                config={"variant": variant},
                control_tokens=CONTROL_TOKENS,
            ).id
        records = []
        examples = [env.example(query) for query in env.train_queries[:queries]]
        for step in range(1, steps + 1):
            rollouts = group_rollouts(examples, variant, step)
            acc = sum(r.true_score or 0 for r in rollouts) / len(rollouts)
            values = {"reward_mean": acc, "true_accuracy": acc}
            records.append(step_record(step, values=values, rollouts=rollouts))
        record_steps(factory, run_id, records)  # one recorder kept, as a trainer's writer
        runs[variant] = run_id
    runs["queries"] = [q.text for q in EscalationEnv(seed=0).train_queries[:queries]]
    return runs
