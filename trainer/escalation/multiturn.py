"""The multi-step Escalation env through TRL's own tool loop: dataset, rewards and trainer.

Plain TRL, nothing subclassed: `GRPOTrainer(environment_factory={listing: ToolBox class})`. Each
dataset row names its `environment` (the listing it shows), so TRL renders only that listing's
tools into the prompt through the chat template and lets the rollout call only those; it makes
one ToolBox per rollout, calls `reset(**row)`, parses every turn with the tokenizer's response
template, runs the calls, appends the results (masked out of the loss by `tool_mask`) and samples
again, up to `max_tool_calling_iterations`. The reward function reads each rollout's messages
into facts (`multistep.read_rollout`) and scores them with the configured verifier; it logs the
facts as TRL metrics (`multiturn/...`) beside TRL's own `tools/call_frequency` and
`tools/failure_frequency`.

Needs transformers >= 5.2 (TRL's `environment_factory`) and a TRL with per-example environments
(tested with trl 1.16 + transformers 5.24).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.trainer.envs import multistep as ms
from rollout_lens.trainer.escalation.grpo import device_memory, grpo_args, needs_checkpointing
from rollout_lens.trainer.recorder.judging import Completion, Judgement

MAX_FAILURES = 4096  # failed rows kept for the next interleaved SFT phase


class MultiTurnJudge:
    """A launched multi-turn run's Judge: each rollout judged by the env from its messages.
    Vote: the tool whose result gave the final answer (else the answer itself; the first call
    is kept beside it in the rollout's meta); true and format-free scores; format-valid: an
    answer and no malformed call. It also keeps the rows that failed for interleaved SFT."""

    def __init__(self) -> None:
        self._failed: list[dict[str, Any]] = []

    def __call__(self, completion: Completion) -> Judgement:
        row = completion.row
        j = judge(completion.messages, row)
        if not j["true_score"] and len(self._failed) < MAX_FAILURES:
            self._failed.append(row)
        return Judgement(
            vote=j["answered_by"] or j["answer"],
            true_score=j["true_score"],
            format_valid=j["answer"] is not None and not j["malformed_calls"],
            format_free=j["format_free"],
        )

    def failures(self) -> list[dict[str, Any]]:
        """The rows whose rollouts failed since the last call (interleaved SFT's examples)."""
        failed, self._failed = self._failed, []
        return failed


def make_env(config: RunConfig) -> ms.MultiStepEnv:
    return ms.MultiStepEnv(
        seed=config.seed, variant=config.variant, k=config.k, mode=config.episodes
    )


def episodes(env: ms.MultiStepEnv, config: RunConfig) -> list[ms.Episode]:
    """One episode per group the run trains on, drawn with the run's seed."""
    return list(env.stream(config.steps * config.prompts_per_step, seed=config.seed))


def dataset_rows(eps: Sequence[ms.Episode]) -> list[dict[str, Any]]:
    """Conversational rows; `environment` picks the ToolBox class listing the episode's tools."""
    return [{**ep.row(), "environment": ms.listing_key(ep.tool_ids)} for ep in eps]


FACT_METRICS = (
    "calls",
    "right_calls",
    "unanswered_calls",
    "malformed_calls",
    "tool_errors",
    "turns",
)


def judge(
    messages: Sequence[dict[str, Any]],
    row: dict[str, Any],
    facts: ms.RolloutFacts | None = None,
) -> dict[str, Any]:
    """Facts, true score and format-free score of one rollout (its completion messages and its
    dataset row; `facts` when the caller has read them already)."""
    if facts is None:
        facts = ms.read_rollout(messages, row["needed"])
    return {
        **facts.as_dict(),
        "true_score": ms.true_score(facts, str(row["answer"])),
        "format_free": ms.format_free_score(messages, row["needed"], str(row["answer"])),
        "first_call_right": facts.first_call == row["needed"][0],
    }


def step_summary(judged: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per-step means of the facts: what the reward function logs as `multiturn/<name>`."""
    n = max(1, len(judged))
    calls = sum(j["calls"] for j in judged)
    summary = {name: sum(j[name] for j in judged) / n for name in FACT_METRICS}
    summary |= {
        "true_accuracy": sum(j["true_score"] for j in judged) / n,
        "answered": sum(j["answer"] is not None for j in judged) / n,
        "first_call_right": sum(bool(j["first_call_right"]) for j in judged) / n,
        "right_call_share": sum(j["right_calls"] for j in judged) / calls if calls else 0.0,
        "chain_followed": sum(bool(j["chain_followed"]) for j in judged) / n,
    }
    return summary


def make_reward_function(config: RunConfig):  # type: ignore[no-untyped-def]
    """TRL reward function: the configured verifier on each rollout's facts (its name names
    TRL's `rewards/<name>` metric). Logs the step's facts through TRL's `log_metric`."""
    verifier = ms.make_verifier(config.verifier, p=config.verifier_noise, seed=config.seed)

    def reward(completions, answer, needed, log_metric=None, **_):  # type: ignore[no-untyped-def]
        rewards, judged = [], []
        for messages, truth, tools in zip(completions, answer, needed, strict=True):
            facts = ms.read_rollout(messages, tools)
            rewards.append(float(verifier(facts, str(truth))))
            judged.append(judge(messages, {"needed": tools, "answer": truth}, facts))
        if log_metric is not None:  # TRL >= 1.13 hands reward functions a metric logger
            for name, value in step_summary(judged).items():
                log_metric(f"multiturn/{name}", value)
        return rewards

    reward.__name__ = config.verifier
    return reward


def make_trainer(  # type: ignore[no-untyped-def]
    config: RunConfig,
    model,
    tokenizer,
    output_dir: Path,
    *,
    callbacks: Sequence[Any] = (),
    checkpoint_every: int = 0,
):
    """A plain GRPOTrainer on the multi-step env; any model whose chat template TRL can drive
    tools through (the tiny multi-turn model, a Qwen chat template, ...)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    env = make_env(config)
    eps = episodes(env, config)
    rows = dataset_rows(eps)
    with warnings.catch_warnings():
        # environment_factory is marked experimental by TRL; that is known and accepted here.
        warnings.filterwarnings("ignore", message="You are using 'environment_factory'")
        trainer = GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=[make_reward_function(config)],
            args=grpo_args(
                config,
                output_dir,
                checkpoint_every=checkpoint_every,
                activation_checkpointing=needs_checkpointing(
                    config, model, tokenizer, (row["prompt"] for row in rows), device_memory()
                ),
            ),
            train_dataset=Dataset.from_list(rows),
            environment_factory=ms.environment_factories(env, eps),
            callbacks=list(callbacks) or None,
        )
    return trainer
