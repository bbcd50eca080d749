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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_lens.server.config import Settings
from rollout_lens.server.domain.runconfig import RunConfig
from rollout_lens.server.models import RunStatus
from rollout_lens.server.records import StepRecord
from rollout_lens.trainer.callback import RolloutLensCallback
from rollout_lens.trainer.envs import multistep as ms


@dataclass(frozen=True)
class MultiTurnConfig:
    """What a multi-turn run takes: the multi-turn part of a RunConfig (`config_from_run`), or
    given directly by a script or test that drives TRL itself."""

    variant: str = "patched"
    k: int = 4
    mode: str = "mixed"  # single, chain or mixed episodes
    steps: int = 30
    group_size: int = 8
    prompts_per_step: int = 1
    learning_rate: float = 3e-4
    temperature: float = 1.0
    max_completion_tokens: int = 128  # all turns together, tool results included
    max_calls: int = ms.DEFAULT_MAX_CALLS  # TRL's max_tool_calling_iterations
    verifier: str = "exact"
    verifier_noise: float = 0.1
    kl_coef: float = 0.0
    seed: int = 0


def config_from_run(config: RunConfig) -> MultiTurnConfig:
    """The multi-turn part of a launched run's RunConfig."""
    return MultiTurnConfig(
        variant=config.variant,
        k=config.k,
        mode=config.episodes,
        steps=config.steps,
        group_size=config.group_size,
        prompts_per_step=config.prompts_per_step,
        learning_rate=config.learning_rate,
        temperature=config.temperature,
        max_completion_tokens=config.max_completion_tokens,
        max_calls=config.max_calls,
        verifier=config.verifier,
        verifier_noise=config.verifier_noise,
        kl_coef=config.kl_coef,
        seed=config.seed,
    )


MAX_FAILURES = 4096  # failed rows kept for the next interleaved SFT phase


class _WriterBox:
    """A launched run's StepBox: each raw step prepared on the spot and handed to the worker's
    StepWriter, which owns the run row (the worker marks it finished)."""

    def __init__(self, prepare: Callable[[Any], StepRecord], sink: Callable[[StepRecord], None]):
        self.prepare, self.sink = prepare, sink

    def put(self, raw: Any) -> None:
        self.sink(self.prepare(raw))

    def close(self, *, status: RunStatus, error: str | None) -> None:
        return None


def _by_messages(text: str, row: dict[str, Any]) -> None:  # pragma: no cover - a marker
    raise AssertionError("judged from the messages (LaunchedCallback._judged)")


class LaunchedCallback(RolloutLensCallback):
    """The callback recording a multi-turn run the worker launched: steps go to the worker's
    StepWriter instead of an Outbox, each rollout is judged by the env from its messages (vote:
    the first tool called; true and format-free scores; format-valid: an answer and no
    malformed call), and a stop request ends training after the step."""

    def __init__(
        self,
        sink: Callable[[StepRecord], None],
        *,
        should_stop: Callable[[], bool],
        control_tokens: Sequence[str] | None,
        keep_tokens_every: int | None,
        settings: Settings,
    ) -> None:
        super().__init__(
            project="",
            control_tokens=control_tokens,
            keep_tokens_every=keep_tokens_every,
            settings=settings,
        )
        self.sink, self.should_stop = sink, should_stop
        self.judges = dict.fromkeys(self.judges, _by_messages)
        self._extra: dict[int, dict[str, float | None]] = {}
        self._failed: list[dict[str, Any]] = []

    def add_metrics(self, step: int, metrics: dict[str, float | None]) -> None:
        """Extra series for `step` (evaluation, SFT phases), written with that step."""
        self._extra.setdefault(step, {}).update(metrics)

    def failures(self) -> list[dict[str, Any]]:
        """The rows whose rollouts failed since the last call (interleaved SFT's examples)."""
        failed, self._failed = self._failed, []
        return failed

    def _prepare(self, raw: dict[str, Any]) -> StepRecord:
        record = super()._prepare(raw)
        for step in [s for s in self._extra if s <= record.step]:
            record.metrics.update(self._extra.pop(step))
        return record

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.outbox = _WriterBox(self._prepare, self.sink)

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        super().on_step_end(args, state, control, **kwargs)
        if self.should_stop():
            control.should_training_stop = True

    def _judged(self, text: str, row: dict[str, Any], completion: Any) -> dict[str, Any]:
        j = judge(completion, row)
        if not j["true_score"] and len(self._failed) < MAX_FAILURES:
            self._failed.append(row)
        return {
            "vote": j["first_call"],
            "true_score": j["true_score"],
            "format_valid": j["answer"] is not None and not j["malformed_calls"],
            "format_free": j["format_free"],
        }


def make_env(config: MultiTurnConfig) -> ms.MultiStepEnv:
    return ms.MultiStepEnv(seed=config.seed, variant=config.variant, k=config.k, mode=config.mode)


def episodes(env: ms.MultiStepEnv, config: MultiTurnConfig) -> list[ms.Episode]:
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


def make_reward_function(config: MultiTurnConfig):  # type: ignore[no-untyped-def]
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


def grpo_args(config: MultiTurnConfig, output_dir: Path, **overrides: Any):  # type: ignore[no-untyped-def]
    """TRL's config: G rollouts x prompts_per_step groups per step, up to max_calls tool turns."""
    import torch
    from trl import GRPOConfig

    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": config.group_size * config.prompts_per_step,
        "num_generations": config.group_size,
        "steps_per_generation": 1,
        "gradient_accumulation_steps": 1,
        "max_steps": config.steps,
        "learning_rate": config.learning_rate,
        "lr_scheduler_type": "constant",
        "temperature": config.temperature,
        "max_completion_length": config.max_completion_tokens,
        "max_tool_calling_iterations": config.max_calls,
        "beta": config.kl_coef,
        "seed": config.seed,
        "data_seed": config.seed,
        "shuffle_dataset": False,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "bf16": cuda and torch.cuda.is_bf16_supported(),
        "activation_checkpointing": False,
        "use_cpu": not cuda,
        "dataloader_num_workers": 0,
    }
    return GRPOConfig(**(kwargs | overrides))


def make_trainer(  # type: ignore[no-untyped-def]
    config: MultiTurnConfig,
    model,
    tokenizer,
    output_dir: Path,
    *,
    callbacks: Sequence[Any] = (),
    **args_overrides: Any,
):
    """A plain GRPOTrainer on the multi-step env; any model whose chat template TRL can drive
    tools through (the tiny multi-turn model, a Qwen chat template, ...)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    env = make_env(config)
    eps = episodes(env, config)
    with warnings.catch_warnings():
        # environment_factory is marked experimental by TRL; that is known and accepted here.
        warnings.filterwarnings("ignore", message="You are using 'environment_factory'")
        trainer = GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=[make_reward_function(config)],
            args=grpo_args(config, output_dir, **args_overrides),
            train_dataset=Dataset.from_list(dataset_rows(eps)),
            environment_factory=ms.environment_factories(env, eps),
            callbacks=list(callbacks) or None,
        )
    return trainer
