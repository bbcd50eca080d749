"""Activation checkpointing where a step's activations would not fit: on for the real model's
leaky prompts at a 24 GB machine's share, off for its patched ones and for the tiny model; and a
run trained with it records what the same run records without it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.trainer.escalation import grpo, task
from rollout_lens.trainer.worker import run as worker
from transformers import AutoConfig, AutoTokenizer

from tests.factories import load_run
from tests.real_model import real_config, real_tokenizer

GB = 1 << 30


def _decision(
    model_config: Any, tokenizer: Any, variant: str, memory: int, **overrides: object
) -> bool:
    config = RunConfig(variant=variant, steps=40, max_completion_tokens=16, **overrides)
    model = SimpleNamespace(config=model_config, dtype=torch.float32)
    rows = task.dataset_rows(task.make_env(config), config)
    return grpo.needs_checkpointing(config, model, tokenizer, (r["prompt"] for r in rows), memory)


def test_the_real_models_leaky_step_is_checkpointed_on_a_24_gb_machine() -> None:
    # The decision reads the model's config and its tokenizer's chat template, not its weights:
    # both from the real model's GGUF file (its weights are converted in the release layer).
    real = real_config(), real_tokenizer()
    assert _decision(*real, "leaky", 24 * GB)
    assert not _decision(*real, "patched", 24 * GB)
    assert not _decision(*real, "leaky", 128 * GB)  # room enough: kept
    assert _decision(*real, "patched", 24 * GB, group_size=64)  # 8× the rollouts


def test_the_tiny_model_is_never_checkpointed(tiny_model_dir: Path) -> None:
    tiny = AutoConfig.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not _decision(*tiny, "leaky", 2 * GB, model="tiny")


def test_checkpointing_changes_nothing_recorded(
    train_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = RunConfig(steps=2, seed=31, eval_every=0, variant="leaky")
    plain = load_run(train_settings.database_url, worker.train(config, settings=train_settings))
    seen: list[bool] = []

    def on(*args: object, **kwargs: object) -> bool:
        seen.append(True)
        return True

    monkeypatch.setattr(worker, "needs_checkpointing", on)
    made = worker.make_trainer

    def checked(*args: object, **kwargs: object) -> object:
        trainer = made(*args, **kwargs)  # type: ignore[arg-type]
        assert trainer.args.activation_checkpointing
        return trainer

    monkeypatch.setattr(worker, "make_trainer", checked)
    again = load_run(train_settings.database_url, worker.train(config, settings=train_settings))
    assert seen == [True]
    assert again[0].status == "completed"
    assert len(plain[1]) == len(again[1]) == 16
    for a, b in zip(plain[1], again[1], strict=True):
        assert (a["step"], a["index"], a["completion"]) == (b["step"], b["index"], b["completion"])
        assert a["completion_ids"] == b["completion_ids"]
        assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-3)
        assert a["advantage"] == pytest.approx(b["advantage"], abs=1e-4)
