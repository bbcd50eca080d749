"""Greedy evaluation every E steps: in-distribution, format-OOD and content-OOD accuracy."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from rollout_lens.server.core import vocab
from rollout_lens.trainer.escalation.supervision import MetricSink
from transformers import GenerationConfig, TrainerCallback


@dataclass(frozen=True)
class EvalItem:
    """One prompt (user message), the target id, and how to read the reply's vote."""

    prompt: str
    target: str
    parse: Callable[[str], str | None]


class Evaluator(TrainerCallback):
    """Every `every` steps (and after the last), greedy accuracy on each named set → `eval/<set>`."""

    def __init__(
        self,
        trainer: Any,  # a GRPOTrainer
        recorder: MetricSink,
        sets: Mapping[str, Sequence[EvalItem]],
        *,
        every: int,
        max_new_tokens: int,
        batch_size: int = 32,
    ) -> None:
        self.trainer, self.recorder, self.sets = trainer, recorder, sets
        self.every, self.max_new_tokens, self.batch_size = every, max_new_tokens, batch_size

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        last = state.global_step >= state.max_steps or control.should_training_stop
        if state.global_step % self.every == 0 or last:
            self.recorder.add_metrics(state.global_step, self.evaluate())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float | None]:
        """Accuracy of greedy replies on each set."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        was_training = model.training
        model.eval()
        try:
            return {
                vocab.eval_set(name): self._accuracy(model, items)
                for name, items in self.sets.items()
            }
        finally:
            model.train(was_training)

    def _accuracy(self, model: torch.nn.Module, items: Sequence[EvalItem]) -> float | None:
        if not items:
            return None
        tokenizer = self.trainer.processing_class
        correct = 0
        for start in range(0, len(items), self.batch_size):
            batch = items[start : start + self.batch_size]
            prompt_ids, _, _ = self.trainer._tokenize_prompts(
                [[{"role": "user", "content": i.prompt}] for i in batch]
            )
            width = max(len(p) for p in prompt_ids)
            pad = tokenizer.pad_token_id
            device = self.trainer.accelerator.device
            ids = torch.tensor(
                [[pad] * (width - len(p)) + list(p) for p in prompt_ids], device=device
            )
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device
            )
            greedy = GenerationConfig(
                do_sample=False,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=pad,
                eos_token_id=self.trainer.eos_token_ids,
            )
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy)
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            correct += sum(
                item.parse(text) == item.target for item, text in zip(batch, texts, strict=True)
            )
        return correct / len(items)
