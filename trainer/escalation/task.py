"""The Escalation task as TRL sees it: a dataset of prompts, a reward function and a judge."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.trainer.envs import warmup
from rollout_lens.trainer.envs.onestep import (
    TOOL_COUNT,
    EscalationEnv,
    Example,
    format_valid,
    lenient_vote,
    make_verifier,
    parse_vote,
    parse_vote_format,
    reply,
    true_score,
)
from rollout_lens.trainer.escalation.evaluation import EvalItem
from rollout_lens.trainer.escalation.supervision import Failures
from rollout_lens.trainer.recorder.judging import Completion, Judgement, message_text
from rollout_lens.trainer.recorder.structure import classify


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
                    message_text(c),
                    Example(
                        query=q,
                        prompt=message_text(p),
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


def judge(completion: Completion) -> Judgement:
    """Vote, true score and format state of one Escalation completion."""
    text, row = completion.text, completion.row
    vote = parse_vote(text)
    return Judgement(
        vote=vote,
        true_score=true_score(vote, row["target"]),
        format_valid=format_valid(text, row["tool_ids"]),
        format_state=classify(text, row["tool_ids"]).value,
        format_free=true_score(lenient_vote(text), row["target"]),
    )


def failures() -> Failures:
    """The (prompt messages, target) of rollouts that missed: erroneous-example SFT's data."""
    return Failures(
        lambda r: true_score(parse_vote(message_text(r.completion)), r.row["target"]) == 0,
        lambda r: (r.prompt, r.row["target"]),
    )


def expert_reply(target: str) -> str:
    """The correct reply for a target id."""
    return reply(target)


def hinted_prompt(row: dict[str, Any]) -> list[dict[str, str]]:
    """The row's prompt with its hint appended (what hint-guided rollouts are sampled from)."""
    content = message_text(row["prompt"])
    return [{"role": "user", "content": f"{content}\n{row['hint']}"}]


def sft_examples(env: EscalationEnv) -> list[tuple[Any, str]]:
    """(prompt messages, target) for every training query: SFT-then-RL's data."""
    examples = [env.example(q) for q in env.train_queries]
    return [([{"role": "user", "content": ex.prompt}], ex.target) for ex in examples]


def warmup_examples(env: EscalationEnv) -> list[tuple[Any, str]]:
    """(prompt messages, target) of the format warm-up: no training query, capability or id."""
    return [([{"role": "user", "content": ex.prompt}], ex.target) for ex in warmup.examples(env)]


def _vote_reader(reply_format: str) -> Callable[[str], str | None]:
    """The vote of a greedy reply in `reply_format`."""
    return lambda text: parse_vote_format(text.strip(), reply_format)


def eval_sets(env: EscalationEnv) -> dict[str, list[EvalItem]]:
    """In-distribution (training queries), format-OOD (other reply formats), content-OOD (paraphrases)."""

    def items(queries, reply_format: str) -> list[EvalItem]:  # type: ignore[no-untyped-def]
        out = []
        for q in queries:
            ex = env.example(q, reply_format=reply_format)
            out.append(EvalItem(ex.prompt, ex.target, _vote_reader(reply_format)))
        return out

    return {
        "id": items(env.train_queries, "tag"),
        "format_ood": items(env.train_queries, "bracket") + items(env.train_queries, "json"),
        "content_ood": items(env.heldout_queries, "tag"),
    }
