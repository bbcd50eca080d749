"""TRL's GRPOConfig for a run launched from the dashboard, single- or multi-turn: one place."""

from __future__ import annotations

from pathlib import Path

from rollout_lens.server.core.runconfig import RunConfig


def grpo_args(config: RunConfig, output_dir: Path, *, checkpoint_every: int = 0):  # type: ignore[no-untyped-def]
    """TRL's config for one run: G rollouts × prompts_per_step groups per optimizer step (and up
    to max_calls tool turns for a multi-turn run)."""
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
        # TRL defaults both on; bf16 only pays on CUDA and checkpointing only for big models.
        bf16=cuda and torch.cuda.is_bf16_supported(),
        activation_checkpointing=False,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        **multi,
    )
