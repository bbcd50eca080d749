"""Recording GRPO: TRL's GRPOTrainer plus a callback that streams every step and rollout to SQL.

The trainer subclass captures the rollouts of each generation in group order (before
`_prepare_inputs` shuffles them) and the sampling probabilities (through GenerationProbe); the
callback pairs them with TRL's logged loss/KL/grad-norm of the step that trained on them.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from rollout_lens.server import series as vocab
from rollout_lens.server.records import RolloutRecord, StepRecord
from rollout_lens.trainer import metrics as m
from rollout_lens.trainer import positional, turns
from rollout_lens.trainer.probe import GenerationProbe
from transformers import LogitsProcessorList, TrainerCallback
from trl import GRPOTrainer


@dataclass(frozen=True)
class Judgement:
    """What a task says about one completion besides the training reward."""

    vote: str | None
    true_score: float | None
    format_valid: bool
    format_state: str | None
    format_free: float | None = None  # the answer read leniently, whatever the structure


Judge = Callable[[str, dict[str, Any], bool], Judgement]  # (completion, dataset row, truncated)

# TRL log keys that have a column of their own on the steps table.
_LOG_COLUMNS = {
    "loss": "loss",
    "kl": "kl",
    "entropy": "entropy",
    "grad_norm": "grad_norm",
    "learning_rate": "learning_rate",
}
# Logged numbers that are not a step's series (the end-of-training summary, counters).
_NOT_SERIES = {"epoch", "step", "total_flos"}


def split_logs(logs: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """A step's TRL logs as (step columns, other series named `trl/<key>`)."""
    columns: dict[str, float] = {}
    series: dict[str, float] = {}
    for key, value in logs.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        if key in _LOG_COLUMNS:
            columns[_LOG_COLUMNS[key]] = float(value)
        elif key not in _NOT_SERIES and not key.startswith("train_"):
            series[vocab.trl(key)] = float(value)
    return columns, series


def summarize(
    rollouts: Sequence[RolloutRecord],
    group_size: int,
    control_tokens: Sequence[str],
    top_reward: float = 1.0,
):
    """Per-step values and extra series computed from the rollouts of one generation
    (`top_reward`: the verifier's best reward, what a solved group's rollouts all got)."""
    grouped = m.groups(rollouts, group_size)
    scored = [r.true_score for r in rollouts if r.true_score is not None]
    values: dict[str, float | None] = {
        "reward_mean": m.mean([r.verifier_reward for r in rollouts]),
        "true_accuracy": m.mean(scored),
        "format_valid_rate": m.mean([float(r.format_valid) for r in rollouts]),
        "vote_agreement": m.mean([m.vote_agreement([r.vote for r in g]) for g in grouped]),
        "vote_entropy": m.mean([m.vote_entropy([r.vote for r in g]) for g in grouped]),
        "zero_std_share": m.mean(
            [float(m.is_zero_std([r.verifier_reward for r in g])) for g in grouped]
        ),
        "completion_length": m.mean([float(len(r.completion_ids)) for r in rollouts]),
    }
    spread = [m.no_spread([r.verifier_reward for r in g], top_reward) for g in grouped]
    series: dict[str, float | None] = {
        vocab.SOLVED_GROUPS: m.mean([float(s == "solved") for s in spread]),
        vocab.STUCK_GROUPS: m.mean([float(s == "stuck") for s in spread]),
    }
    # tool-calling rollouts: only the positions the model sampled (tool results hold 0.0)
    sampled = [turns.model_positions(r.meta, len(r.completion_ids)) for r in rollouts]
    for token in control_tokens:
        probs = [
            p
            for r, keep in zip(rollouts, sampled, strict=True)
            for p in (
                r.control_probs.get(token, [])
                if keep is None
                else [p for p, k in zip(r.control_probs.get(token, []), keep, strict=False) if k]
            )
        ]
        series[vocab.ctrl(token, "mean")] = m.mean(probs)
        series[vocab.ctrl(token, "max")] = max(probs) if probs else None
    states = [r.format_state for r in rollouts if r.format_state]
    for state in sorted({*vocab.FormatState, *states}):
        series[vocab.state(state)] = states.count(state) / len(states) if states else None
    series.update(
        positional.aggregate(
            [r.meta.get("probes", {}) for r in rollouts],
            [r.verifier_reward >= 0.5 for r in rollouts],
            [bool(r.meta.get("supervised")) for r in rollouts],
        )
    )
    lenient = [r.meta[vocab.FORMAT_FREE_KEY] for r in rollouts if vocab.FORMAT_FREE_KEY in r.meta]
    if lenient:
        series[vocab.FORMAT_FREE_ACCURACY] = m.mean([float(x) for x in lenient])
    series.update(turns.step_series(rollouts))
    listed = [r.meta["target_listed"] for r in rollouts if "target_listed" in r.meta]
    if listed:
        series[vocab.RETRIEVAL_RECALL] = m.mean([float(x) for x in listed])
    return values, series


class Recorder(TrainerCallback):
    """Pairs each step's logs with the rollouts it trained on and hands a StepRecord on."""

    def __init__(
        self,
        sink: Callable[[StepRecord], None],
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.sink = sink
        self.should_stop = should_stop
        self._pending: tuple[int, list[RolloutRecord], dict, dict] | None = None
        self._last: tuple[int, dict, dict] | None = None  # rollout step, values, series
        self._extra: dict[int, dict[str, float | None]] = {}  # step -> series from callbacks
        self._step_started = 0.0

    def add_rollouts(
        self, step: int, rollouts: list[RolloutRecord], values: dict, series: dict
    ) -> None:
        """Rollouts generated for the update at `step` (called from the trainer)."""
        self._pending = (step, rollouts, values, series)

    def add_metrics(self, step: int, metrics: dict[str, float | None]) -> None:
        """Extra series for `step` (evaluation, SFT phases), written with that step."""
        self._extra.setdefault(step, {}).update(metrics)

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.should_stop is not None and self.should_stop():
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if not logs or "loss" not in logs:
            return  # the end-of-training summary, not a step
        step = state.global_step
        rollouts: list[RolloutRecord] = []
        if self._pending is not None:
            rollout_step, rollouts, values, series = self._pending
            self._pending = None
            self._last = (rollout_step, values, series)
        elif self._last is not None:
            rollout_step, values, series = (
                self._last
            )  # GRPO reusing a generation (num_iterations > 1)
        else:
            rollout_step, values, series = step, {}, {}
        step_values = dict(values)
        step_values["wall_time"] = time.perf_counter() - self._step_started
        extra = dict(series)
        for early in [s for s in self._extra if s <= step]:
            extra.update(self._extra.pop(early))
        columns, logged = split_logs(logs)
        step_values.update(columns)
        extra.update(logged)
        self.sink(
            StepRecord(
                step=step,
                rollout_step=rollout_step,
                values=step_values,
                rollouts=rollouts,
                metrics=extra,
            )
        )


class RecordingGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that hands every generation's rollouts, in group order, to a Recorder."""

    def __init__(
        self,
        *args: Any,
        recorder: Recorder,
        control_tokens: Sequence[str],
        judge: Judge | None = None,
        id_tokens: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        """`control_tokens` are (opening tag, closing tag, end-of-turn) when there are three;
        `id_tokens` are the answer tokens (tool ids) whose distribution is probed at the id position."""
        super().__init__(*args, **kwargs)
        if self.args.steps_per_generation != 1 or self.args.gradient_accumulation_steps != 1:
            raise ValueError(
                "recording needs steps_per_generation=1 and gradient_accumulation_steps=1"
            )
        self.recorder = recorder
        self.add_callback(recorder)
        self.judge = judge
        self.control_tokens = list(control_tokens)
        vocab = self.processing_class.get_vocab()
        missing = [t for t in self.control_tokens if t not in vocab]
        if missing:
            raise ValueError(f"control tokens not in the tokenizer's vocabulary: {missing}")
        self._control_ids = [vocab[t] for t in self.control_tokens]
        self.id_tokens = [t for t in id_tokens if t in vocab]
        self._id_ids = [vocab[t] for t in self.id_tokens]
        self._roles = dict(zip(("open_tag", "close_tag", "eot"), self.control_tokens, strict=False))
        self._prompt_text: dict[str, str] = {}
        self._inputs: list[dict[str, Any]] = []  # the rows of the generation in progress
        self._row_meta: dict[int, dict[str, Any]] = {}  # row -> meta added by subclasses
        # (prompt messages, target) of recent rollouts that missed: erroneous-example SFT's data
        self.recent_failures: deque[tuple[Any, str]] = deque(maxlen=4096)
        self._probe_rows: tuple[list, list, list] | None = None
        self._scored: tuple[list, list, torch.Tensor] | None = None

    # -- capture ---------------------------------------------------------------------------------

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):  # type: ignore[no-untyped-def]
        probe = GenerationProbe(
            self._control_ids,
            self.temperature,
            after_token_id=self._control_ids[0] if len(self._roles) == 3 else None,
            watch_ids=self._id_ids,
        )
        model = self.accelerator.unwrap_model(self.model)
        # TRL calls model.generate without processors; bind ours for this one call.
        model.generate = functools.partial(
            type(model).generate, model, logits_processor=LogitsProcessorList([probe])
        )
        try:
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        finally:
            del model.generate
        if probe.used:
            logprobs_rows, control_rows = probe.finish(completion_ids)
            self._probe_rows = (
                logprobs_rows,
                control_rows,
                [probe.watched(i) for i in range(len(completion_ids))],
            )
        return completion_ids, logprobs

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[no-untyped-def]
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        self._scored = (completions, completion_ids_list, rewards_per_func)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):  # type: ignore[no-untyped-def]
        self._probe_rows, self._scored = None, None
        self._inputs, self._row_meta = inputs, {}
        output = super()._generate_and_score_completions(inputs)
        if self.model.training and self._scored is not None:
            self._record(inputs, output)
        return output

    # -- building records ------------------------------------------------------------------------

    def _record(self, inputs: list[dict[str, Any]], output: dict[str, Any]) -> None:
        completions, completion_ids, rewards_per_func = self._scored  # type: ignore[misc]
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1).tolist()
        advantages = output["advantages"].tolist()
        if self._probe_rows is not None:
            token_logprobs, control, watched = self._probe_rows
        else:  # e.g. vLLM generation: no probe, use TRL's sampling logprobs where it has them
            sampling = output.get("sampling_per_token_logps")
            token_logprobs = (
                [
                    row[: len(ids)]
                    for row, ids in zip(sampling.tolist(), completion_ids, strict=True)
                ]
                if sampling is not None
                else [[] for _ in completion_ids]
            )
            control = [[[] for _ in self.control_tokens] for _ in completion_ids]
            watched = [None for _ in completion_ids]
        eos = set(self.eos_token_ids)
        rollouts = []
        for i, row in enumerate(inputs):
            text = message_text(completions[i])
            ids = list(completion_ids[i])
            truncated = not ids or ids[-1] not in eos
            judgement = (
                self.judge(text, row, truncated)
                if self.judge
                else Judgement(None, None, True, None)
            )
            control_probs = dict(zip(self.control_tokens, control[i], strict=True))
            tokens = self.processing_class.convert_ids_to_tokens(ids)
            meta = {k: v for k, v in row.items() if k not in ("prompt", "target")}
            meta["probes"] = self._probes(tokens, control_probs, watched[i], row)
            if judgement.format_free is not None:
                meta[vocab.FORMAT_FREE_KEY] = judgement.format_free
            meta.update(self._row_meta.get(i, {}))
            rollouts.append(
                RolloutRecord(
                    group=i // self.num_generations,
                    index=i % self.num_generations,
                    prompt=self._render_prompt(row["prompt"]),
                    completion=text,
                    completion_ids=ids,
                    token_logprobs=list(token_logprobs[i]),
                    control_probs=control_probs,
                    vote=judgement.vote,
                    target=row.get("target"),
                    verifier_reward=float(rewards[i]),
                    true_score=judgement.true_score,
                    advantage=float(advantages[i]),
                    format_valid=judgement.format_valid,
                    format_state=judgement.format_state,
                    meta=meta,
                    tokens=tokens,
                )
            )
        for r, row in zip(rollouts, inputs, strict=True):
            if r.true_score == 0.0 and r.target is not None:
                self.recent_failures.append((row["prompt"], r.target))
        values, series = summarize(rollouts, self.num_generations, self.control_tokens)
        self.recorder.add_rollouts(self.state.global_step + 1, rollouts, values, series)

    @torch.no_grad()
    def forward_probe(self, prompt_ids: list[int], completion_ids: list[int]):  # type: ignore[no-untyped-def]
        """Logprobs, control probs and id-position logprobs of a completion the policy did not
        sample (an expert reply): one no-grad forward at the sampling temperature."""
        model = self.accelerator.unwrap_model(self.model)
        ids = torch.tensor([prompt_ids + completion_ids], device=self.accelerator.device)
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
        logprobs = torch.log_softmax(logits / self.temperature, dim=-1)
        sampled = logprobs.gather(1, ids[0, len(prompt_ids) :, None]).squeeze(1).tolist()
        control = logprobs[:, self._control_ids].exp().T.tolist()
        watched = None
        if len(self._roles) == 3 and self._id_ids and self._control_ids[0] in completion_ids:
            position = completion_ids.index(self._control_ids[0]) + 1
            if position < len(completion_ids):
                watched = logprobs[position, self._id_ids].tolist()
        return sampled, control, watched

    def _probes(self, tokens, control_probs, watched, row) -> dict[str, float | None]:  # type: ignore[no-untyped-def]
        """Positional control-token probes and, where the task lists ids, the id-position probes."""
        probes: dict[str, float | None] = {}
        if len(self._roles) == 3:
            probes.update(positional.control_probes(tokens, control_probs, **self._roles))
        if watched is not None:
            by_id = dict(zip(self.id_tokens, watched, strict=True))
            probes.update(positional.id_probes(by_id, row.get("tool_ids") or [], row.get("target")))
        return probes

    def _render_prompt(self, prompt: Any) -> str:
        """The prompt as the model saw it (chat template applied), rendered once per text."""
        if isinstance(prompt, str):
            return prompt
        key = repr(prompt)
        if key not in self._prompt_text:
            self._prompt_text[key] = self.processing_class.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
            )
        return self._prompt_text[key]


def message_text(completion: Any) -> str:
    """TRL gives a string, or for conversational prompts a list of messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion)
