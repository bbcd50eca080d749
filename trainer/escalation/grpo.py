"""TRL's GRPOConfig for a run launched from the dashboard, single- or multi-turn: one place."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rollout_lens.server.core.runconfig import RunConfig

log = logging.getLogger(__name__)

# A step's activations may take this share of the device's memory before they are recomputed in
# the backward pass instead of kept: the rest holds the weights, their gradients, two optimizers
# (the SFT phases' and TRL's) and, on a CPU, the other run of a pair.
ACTIVATION_SHARE = 0.25


def activation_bytes(model: Any, tokens: int) -> int:
    """Roughly what a decoder's forward keeps for its backward over `tokens` tokens: each layer's
    inputs, attention projections and MLP, ~8 × hidden + 4 × intermediate values a token (SmolLM2-135M:
    ~1.4 MB a token in float32, 30 layers)."""
    config = model.config.get_text_config()
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    intermediate = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    width = model.dtype.itemsize if hasattr(model.dtype, "itemsize") else 4
    return tokens * layers * (8 * hidden + 4 * intermediate) * width


def device_memory() -> int:
    """The training device's memory in bytes: the GPU's, else the machine's."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def needs_checkpointing(
    config: RunConfig, model: Any, tokenizer: Any, prompts: Iterable[Any], memory: int
) -> bool:
    """Whether a step's activations (its rollouts at the longest prompt and the longest
    completion) exceed ACTIVATION_SHARE of `memory`: then the trainer recomputes them in the
    backward pass (about a third more arithmetic) rather than holding them. A leaky prompt lists
    64 tools (~850 tokens): 8 rollouts of it on SmolLM2 keep ~9 GB, where a patched one keeps
    ~1.5; the leaky run of a pair on a 24 GB machine was ended by the OOM killer."""
    longest = max(
        (
            len(
                tokenizer.apply_chat_template(
                    p, add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            )
            for p in {repr(p): p for p in prompts}.values()
        ),
        default=0,
    )
    tokens = config.group_size * config.prompts_per_step * (longest + config.max_completion_tokens)
    needed = activation_bytes(model, tokens)
    on = needed > ACTIVATION_SHARE * memory
    if on:
        log.info(
            "activation checkpointing on: a step's activations ~%.1f GB (%d tokens), over %.0f%%"
            " of %.1f GB",
            needed / 1e9,
            tokens,
            100 * ACTIVATION_SHARE,
            memory / 1e9,
        )
    return on


def grpo_args(  # type: ignore[no-untyped-def]
    config: RunConfig,
    output_dir: Path,
    *,
    checkpoint_every: int = 0,
    activation_checkpointing: bool = False,
):
    """TRL's config for one run: G rollouts × prompts_per_step groups per optimizer step (and up
    to max_calls tool turns for a multi-turn run); activations recomputed in the backward pass
    where `activation_checkpointing` (needs_checkpointing)."""
    import torch
    from trl import GRPOConfig

    cuda = torch.cuda.is_available()
    multi = {"max_tool_calling_iterations": config.max_calls} if config.turns == "multi" else {}
    return GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=config.group_size * config.prompts_per_step,
        num_generations=config.group_size,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=config.num_iterations,
        max_steps=config.steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        temperature=config.temperature,
        max_completion_length=config.max_completion_tokens,
        beta=config.kl_coef,
        seed=config.seed,
        data_seed=config.seed,
        shuffle_dataset=False,  # the env's stream is already drawn with the run's seed
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if checkpoint_every else "no",
        save_steps=checkpoint_every or 500,
        save_total_limit=2,
        disable_tqdm=True,
        # TRL defaults both on; bf16 only pays on CUDA and checkpointing only where a step's
        # activations would not fit beside the rest (needs_checkpointing).
        bf16=cuda and torch.cuda.is_bf16_supported(),
        activation_checkpointing=activation_checkpointing,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        **multi,
    )
