"""Supervisory signals (the second seed): expert or hinted rollouts inside a GRPO step, and SFT
phases before or between RL phases, on the erroneous examples."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
from rollout_lens.server.core import vocab
from rollout_lens.server.core.task_vocab import BEFORE_RL_MODES, IN_GROUP_MODES
from rollout_lens.trainer.recorder.capture import GenerationHooks
from rollout_lens.trainer.recorder.captured import Sample
from transformers import TrainerCallback

Encoded = tuple[list[int], list[int]]  # a row's ids and its labels (-100: context)
# Rows × padded width of one forward of an SFT step: a step's rows are split into forwards of at
# most this many tokens (one row at least), their gradients summed, so a batch of 16 leaky
# prompts (~870 tokens each) keeps ~2 rows' activations, not 16 (~1.4 MB a token for SmolLM2).
MICRO_BATCH_TOKENS = 2048


class InGroupSupervision(GenerationHooks):
    """Groups that mix in supervised rollouts, through the capture's hooks (a plain GRPOTrainer).

    offpolicy: the last `per_group` rollouts of each group are replaced by the expert reply;
    they are scored and normalised with the group, and measured by one forward pass of the
    policy. hint: the last `per_group` rollouts are sampled from the prompt with a hint
    appended; the update sees the completion under the plain prompt (hint stripped), because
    TRL keeps the prompt ids it tokenized, not the ones generation used.
    """

    def __init__(
        self,
        *,
        mode: str,
        per_group: int,
        expert_reply: Callable[[dict[str, Any]], str],
        hinted_prompt: Callable[[dict[str, Any]], Any],
    ) -> None:
        if mode not in IN_GROUP_MODES:
            raise ValueError(f"unknown in-group supervision {mode!r}")
        self.mode, self.per_group = mode, per_group
        self.expert_reply, self.hinted_prompt = expert_reply, hinted_prompt

    def _rows(self, n_rows: int, group: int) -> list[int]:
        return [i for i in range(n_rows) if i % group >= group - self.per_group]

    def sampling_prompts(self, trainer, prompt_ids, rows, group):  # type: ignore[no-untyped-def]
        if self.mode != "hint":
            return prompt_ids, {}
        sampled_from, meta = list(prompt_ids), {}
        for i in self._rows(len(prompt_ids), group):
            hinted, _, _ = trainer._tokenize_prompts([self.hinted_prompt(rows[i])])
            sampled_from[i] = hinted[0]
            meta[i] = {"supervised": "hint", "hint_shown": rows[i].get("hint")}
        return sampled_from, meta

    def replace_completions(self, trainer, prompt_ids, completion_ids, rows, group):  # type: ignore[no-untyped-def]
        if self.mode != "offpolicy":
            return {}, {}
        eos = trainer.eos_token_ids[0]
        replaced, meta = {}, {}
        for i in self._rows(len(completion_ids), group):
            expert = trainer.processing_class.encode(
                self.expert_reply(rows[i]), add_special_tokens=False
            )
            replaced[i] = [*expert, eos]
            meta[i] = {"supervised": "expert"}
        return replaced, meta


class Failures(GenerationHooks):
    """The rows whose rollouts failed, kept for the next interleaved SFT phase (at most
    `keep`): `failed(rollout)` says which, `example(rollout)` what to keep of one."""

    def __init__(
        self,
        failed: Callable[[Sample], bool],
        example: Callable[[Sample], Any],
        *,
        keep: int = 4096,
    ) -> None:
        self.failed, self.example = failed, example
        self.recent: deque[Any] = deque(maxlen=keep)

    def on_generation(self, rollouts: list[Sample]) -> None:
        self.recent.extend(self.example(r) for r in rollouts if self.failed(r))

    def drain(self) -> list[Any]:
        """The failures since the last call (interleaved SFT's examples)."""
        failures = list(self.recent)
        self.recent.clear()
        return failures


class Hooks(GenerationHooks):
    """Several hooks as one (each sees what the one before returned)."""

    def __init__(self, *hooks: GenerationHooks) -> None:
        self.hooks = hooks

    def sampling_prompts(self, trainer, prompt_ids, rows, group):  # type: ignore[no-untyped-def]
        meta: dict[int, dict[str, Any]] = {}
        for hook in self.hooks:
            prompt_ids, more = hook.sampling_prompts(trainer, prompt_ids, rows, group)
            meta.update(more)
        return prompt_ids, meta

    def replace_completions(self, trainer, prompt_ids, completion_ids, rows, group):  # type: ignore[no-untyped-def]
        replaced: dict[int, list[int]] = {}
        meta: dict[int, dict[str, Any]] = {}
        for hook in self.hooks:
            more, more_meta = hook.replace_completions(
                trainer, prompt_ids, completion_ids, rows, group
            )
            replaced.update(more)
            meta.update(more_meta)
        return replaced, meta

    def on_generation(self, rollouts: list[Sample]) -> None:
        for hook in self.hooks:
            hook.on_generation(rollouts)


class MetricSink(Protocol):
    """Where extra series for a step go (RolloutLensCallback.add_metrics)."""

    def add_metrics(self, step: int, metrics: dict[str, float | None]) -> None: ...


Encoder = Callable[[Any], tuple[list[int], list[int]]]  # example -> (ids, labels, -100 = context)


class SFTPhases(TrainerCallback):
    """Supervised fine-tuning on expert replies, at its own learning rate, on the training thread.

    interleaved_sft: every `every` RL steps, `steps` SFT steps on the examples that failed since
    the last phase (`failures()` drains them: Failures.drain).
    sft_then_rl: `steps` SFT steps on all training examples before the first RL step;
    format_warmup the same on the warm-up's examples (trainer.envs.warmup: other queries, other
    capabilities, other ids). Each phase's loss goes into the series `sft/loss` at the step
    after which it ran (a phase before RL at step 1).

    An example is (prompt, target) with the reply `expert_reply(target)`, or anything `encode`
    turns into (ids, labels): a multi-turn expert conversation, say.
    """

    def __init__(
        self,
        trainer: Any,
        recorder: MetricSink,
        *,
        mode: str,
        every: int,
        steps: int,
        learning_rate: float,
        all_examples: Callable[[], list[Any]],
        expert_reply: Callable[[str], str] | None = None,
        encode: Encoder | None = None,
        failures: Callable[[], list[Any]] = list,
        batch_size: int = 16,
    ) -> None:
        if (expert_reply is None) == (encode is None):
            raise ValueError("SFTPhases needs expert_reply or encode (one of them)")
        self.trainer, self.recorder = trainer, recorder
        self.mode, self.every, self.steps, self.batch_size = mode, every, steps, batch_size
        self.all_examples, self.expert_reply = all_examples, expert_reply
        self.encode: Encoder = encode or self._reply_sequence
        self.failures = failures
        self.learning_rate = learning_rate
        self._optimizer: torch.optim.Optimizer | None = None

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.mode in BEFORE_RL_MODES and state.global_step == 0:
            examples = self.all_examples()
            loss = self._phase(examples)
            self.recorder.add_metrics(
                1, {vocab.SFT_LOSS: loss, vocab.SFT_EXAMPLES: float(len(examples))}
            )

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.mode != "interleaved_sft" or state.global_step % self.every:
            return
        failures = self.failures()
        if failures:
            loss = self._phase(failures)
            self.recorder.add_metrics(
                state.global_step, {vocab.SFT_LOSS: loss, vocab.SFT_EXAMPLES: float(len(failures))}
            )

    def _phase(self, examples: list[Any]) -> float:
        """`steps` SFT steps cycling through `examples`; returns the mean loss."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(model.parameters(), lr=self.learning_rate)
        was_training = model.training
        model.train()
        losses = []
        for step in range(self.steps):
            start = step * self.batch_size % len(examples)
            batch = [
                examples[(start + j) % len(examples)]
                for j in range(min(self.batch_size, len(examples)))
            ]
            self._optimizer.zero_grad(set_to_none=True)
            losses.append(self._backward(model, [self.encode(example) for example in batch]))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        model.train(was_training)
        return sum(losses) / len(losses) if losses else math.nan

    def _backward(self, model: torch.nn.Module, encoded: list[Encoded]) -> float:
        """The batch's mean cross-entropy over its labelled tokens, its gradient accumulated a
        micro-batch at a time (the same gradient as one forward of the whole batch)."""
        labelled = sum(_labelled(labels) for _, labels in encoded)
        total = 0.0
        for rows in _micro_batches(encoded):
            loss = self._loss(model, rows, reduction="sum") / max(labelled, 1)
            loss.backward()
            total += loss.item()
        return total if labelled else math.nan

    def _reply_sequence(self, example: tuple[Any, str]) -> tuple[list[int], list[int]]:
        """A single-turn example: the prompt as context, then the expert reply and end-of-turn."""
        assert self.expert_reply is not None
        prompt, target = example
        eos = self.trainer.eos_token_ids[0]
        prompt_ids, _, _ = self.trainer._tokenize_prompts([prompt])
        tokenizer = self.trainer.processing_class
        reply = tokenizer.encode(self.expert_reply(target), add_special_tokens=False) + [eos]
        return list(prompt_ids[0]) + reply, [-100] * len(prompt_ids[0]) + reply

    def _loss(
        self, model: torch.nn.Module, encoded: list[Encoded], reduction: str = "mean"
    ) -> torch.Tensor:
        """Cross-entropy on the expert's tokens only (the rest is context).

        The rows are padded on the left, so every labelled token lies in the last columns, and
        the head runs on those columns alone (`logits_to_keep`): a leaky prompt is ~870 tokens
        and the reply 11, and the vocabulary's logits of every prompt position (16 × 870 ×
        49,152 floats for SmolLM2, 2.7 GB, three times over with the softmax and its gradient)
        were most of an SFT step's memory. Positions count from each row's first real token, as
        they do with right padding."""
        tokenizer = self.trainer.processing_class
        eos = self.trainer.eos_token_ids[0]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        width = max(len(ids) for ids, _ in encoded)
        # a row's first token is predicted by nothing (with left padding, by a pad): unlabelled
        encoded = [(ids, [-100, *labels[1:]]) for ids, labels in encoded]
        # the columns from the earliest labelled token to the end, over every row
        keep = max(
            len(labels) - next((i for i, x in enumerate(labels) if x != -100), len(labels))
            for _, labels in encoded
        )
        device = self.trainer.accelerator.device
        ids = torch.tensor([[pad] * (width - len(s)) + s for s, _ in encoded], device=device)
        mask = torch.tensor(
            [[0] * (width - len(s)) + [1] * len(s) for s, _ in encoded], device=device
        )
        target = torch.tensor(
            [[-100] * (width - len(lab)) + lab for _, lab in encoded], device=device
        )
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # logits of the last keep + 1 positions: the one before the first labelled token
        # predicts it, the last predicts nothing
        logits = (
            model(
                input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep + 1
            )
            .logits[:, :-1]
            .float()
        )
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            target[:, width - keep :].reshape(-1),
            reduction=reduction,
        )


def _labelled(labels: list[int]) -> int:
    """Tokens the loss is taken on (the first is never predicted)."""
    return sum(x != -100 for x in labels[1:])


def _micro_batches(encoded: list[Encoded]) -> list[list[Encoded]]:
    """`encoded` in order, cut into runs of at most MICRO_BATCH_TOKENS rows × padded width."""
    batches: list[list[Encoded]] = []
    width = 0
    for row in encoded:
        wider = max(width, len(row[0]))
        if batches and batches[-1] and wider * (len(batches[-1]) + 1) <= MICRO_BATCH_TOKENS:
            batches[-1].append(row)
            width = wider
        else:
            batches.append([row])
            width = len(row[0])
    return batches
