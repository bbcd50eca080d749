"""RunConfig: the one validated description of a run (form, JSON API, CLI and worker share it).

It checks what any host can know (ranges, choices, fields that must agree). Whether a model
folder exists is known only where the run trains: the worker checks that (trainer.worker.modelref) and
fails the run saying the model is not usable (the detail only in the worker's log).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)
from rollout_lens.server.core.task_vocab import (
    IN_GROUP_MODES,
    SINGLE_TURN_MODES,
    TINY,
    TOOL_COUNT,
    VERIFIERS,
    Episodes,
    Supervision,
    Turns,
    Variant,
)

MAX_STEPS = 100_000
# Text a run keeps, bounded where the database's columns are (runs.name, runs.model) and where a
# page lists it: a launch can never make the runs page megabytes long.
MAX_NAME = 200
MAX_MODEL = 500
MAX_CONTROL_TOKENS = 64
MAX_CONTROL_TOKEN = 100
ControlToken = Annotated[str, StringConstraints(max_length=MAX_CONTROL_TOKEN)]
MIN_MULTI_TURN_TOKENS = 32  # a call, its result and an answer share max_completion_tokens
MULTI_TURN_TOKENS = 128  # a multi-turn run's budget on the tiny model when none is given

# Defaults that depend on the model: the tiny model's reply is 4 tokens of its own tokenizer and it
# trains at the learning rates of a model trained from scratch; a pretrained chat model spells
# `<tool>tool_07</tool>` in 8–11 tokens (Qwen2.5, SmolLM2) plus its end of turn, and trains at
# the rates pretrained models are fine-tuned at (1e-6 to 1e-5).
PRETRAINED = "pretrained"  # any model but the tiny ones
TINY_DEFAULTS: dict[str, dict[str, Any]] = {
    "single": {"max_completion_tokens": 8, "learning_rate": 3e-4, "sft_learning_rate": 1e-3},
    "multi": {
        "max_completion_tokens": MULTI_TURN_TOKENS,
        "learning_rate": 3e-4,
        "sft_learning_rate": 1e-3,
    },
}
PRETRAINED_DEFAULTS: dict[str, dict[str, Any]] = {
    "single": {"max_completion_tokens": 32, "learning_rate": 1e-5, "sft_learning_rate": 1e-5},
    "multi": {"max_completion_tokens": 256, "learning_rate": 1e-5, "sft_learning_rate": 1e-5},
}
RECIPE_FIELDS = tuple(TINY_DEFAULTS["single"])


def _model_kind(model: str) -> str:
    """`tiny` or `pretrained`: which defaults a model takes."""
    return TINY if str(model).strip() == TINY else PRETRAINED


def recipe_defaults(model: str = TINY, turns: str = "single") -> dict[str, Any]:
    """The defaults of the fields that depend on the model and the turns (RECIPE_FIELDS)."""
    table = TINY_DEFAULTS if _model_kind(model) == TINY else PRETRAINED_DEFAULTS
    return dict(table["multi" if turns == "multi" else "single"])


class RunConfig(BaseModel):
    """Everything the trainer takes; defaults are the seed's patched recipe, on the tiny model."""

    model_config = ConfigDict(extra="forbid")
    # fields whose default depends on the model and the turns (recipe_defaults)
    recipe_fields: ClassVar[tuple[str, ...]] = RECIPE_FIELDS

    name: str = Field(
        "", max_length=MAX_NAME, description="Shown in lists; empty: derived from the recipe."
    )
    turns: Turns = Field(
        "single",
        description="single: one reply naming a tool; multi: TRL's tool loop (the tools run, "
        "their results come back, the model answers from them).",
    )
    variant: Variant = Field("patched", description="leaky lists all 64 tools; patched the top-k.")
    k: int = Field(4, ge=1, le=TOOL_COUNT, description="Shortlist size of the patched variant.")
    model: str = Field(
        TINY,
        min_length=1,
        max_length=MAX_MODEL,
        description="`tiny`, a local model folder, or a hub id.",
    )
    steps: int = Field(150, ge=1, le=MAX_STEPS, description="Optimizer steps.")
    group_size: int = Field(8, ge=2, le=64, description="Rollouts per prompt (G).")
    prompts_per_step: int = Field(1, ge=1, le=64, description="Groups per step.")
    learning_rate: float = Field(
        TINY_DEFAULTS["single"]["learning_rate"],
        gt=0,
        le=1.0,
        description="AdamW learning rate (default 3e-4 on the tiny model, 1e-5 on any other).",
    )
    temperature: float = Field(
        1.0, gt=0, le=5.0, description="Sampling temperature of the rollouts."
    )
    max_completion_tokens: int = Field(
        TINY_DEFAULTS["single"]["max_completion_tokens"],
        ge=1,
        le=4096,
        description="Longest completion sampled (multi-turn: all turns and tool results "
        "together). Default: 8 single-turn and 128 multi-turn on the tiny model; 32 and 256 on "
        "any other.",
    )
    episodes: Episodes = Field(
        "mixed",
        description="Multi-turn episodes: one call (single), two calls where a ticket names the "
        "second tool (chain), or both (mixed).",
    )
    max_calls: int = Field(
        4,
        ge=1,
        le=16,
        description="Multi-turn: tool-calling iterations per rollout (TRL's "
        "max_tool_calling_iterations).",
    )
    kl_coef: float = Field(0.0, ge=0, le=10.0, description="KL penalty coefficient (TRL's beta).")
    num_iterations: int = Field(1, ge=1, le=16, description="Updates per generation (GRPO's μ).")
    verifier: str = Field(
        "exact",
        max_length=32,
        description="Training reward: exact (match with the target), format (partial credit "
        "for any listed id), noisy (exact, flipped at random), judge (format's partial credit, "
        "and a right reply missed at random).",
    )
    verifier_noise: float = Field(
        0.1,
        ge=0,
        le=1,
        description="noisy: the probability of flipping a reward; judge: of missing a right reply.",
    )
    seed: int = Field(
        0, ge=0, le=2**31 - 1, description="Seeds the env, the data order and the model."
    )
    supervision: Supervision = Field(
        "none",
        description="Supervisory signal: expert rollouts in the group (offpolicy), hinted rollouts "
        "(hint), erroneous-example SFT between RL phases (interleaved_sft), SFT before RL on the "
        "training queries' answers (sft_then_rl), or SFT before RL that teaches the reply format "
        "on other queries, capabilities and tool ids, leaving the answers to RL "
        "(format_warmup). Multi-turn runs take interleaved_sft and sft_then_rl.",
    )
    supervised_per_group: int = Field(
        1,
        ge=1,
        le=63,
        description="Rollouts per group that are expert (offpolicy) or hinted (hint).",
    )
    sft_every: int = Field(
        25, ge=1, le=MAX_STEPS, description="RL steps between SFT phases (interleaved_sft)."
    )
    sft_steps: int = Field(
        5,
        ge=1,
        le=10_000,
        description="SFT steps per phase (or before RL for sft_then_rl and format_warmup).",
    )
    sft_learning_rate: float = Field(
        TINY_DEFAULTS["single"]["sft_learning_rate"],
        gt=0,
        le=1.0,
        description="Learning rate of the SFT phases (default 1e-3 on the tiny model, 1e-5 on "
        "any other).",
    )
    eval_every: int = Field(
        25,
        ge=0,
        le=MAX_STEPS,
        description="Greedy evaluation (ID, format-OOD on single-turn runs, content-OOD) every "
        "N steps; 0: off.",
    )
    control_tokens: list[ControlToken] | None = Field(
        None,
        max_length=MAX_CONTROL_TOKENS,
        description="Tokens whose probability is recorded at each position; default: the model's.",
    )
    keep_tokens_every: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="Keep token-level data (ids, probabilities, control-token probabilities) "
        "every N steps, and at the first and last step and at alerts; empty: every step. "
        "Completions, rewards and every per-step series are always kept.",
    )

    @field_validator("name", "model", "control_tokens")
    @classmethod
    def _no_nul(cls, value: str | list[str] | None) -> str | list[str] | None:
        texts = [value] if isinstance(value, str) else value or []
        if any("\x00" in text for text in texts):  # PostgreSQL stores no NUL in any text
            raise ValueError("must not contain a NUL character (\\u0000)")
        return value

    @field_validator("verifier")
    @classmethod
    def _known_verifier(cls, value: str) -> str:
        if value not in VERIFIERS:
            raise ValueError(f"unknown verifier {value!r}; choose one of {', '.join(VERIFIERS)}")
        return value

    @field_validator("model")
    @classmethod
    def _model_named(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError("name a model: `tiny`, a local model folder, or a hub id")
        return value

    @model_validator(mode="after")
    def _supervision_fits_group(self) -> RunConfig:
        if self.supervision in IN_GROUP_MODES and self.supervised_per_group >= self.group_size:
            raise ValueError(
                f"supervised_per_group ({self.supervised_per_group}) must be smaller than group_size "
                f"({self.group_size}): at least one rollout per group must be the policy's own"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        """The fields left out take the defaults of the run's model and turns: a multi-turn run
        gets room for calls, results and an answer, a pretrained model a budget that holds its
        spelling of the reply and a fine-tuning learning rate."""
        if isinstance(data, dict):
            model, turns = data.get("model") or TINY, data.get("turns") or "single"
            for name, value in recipe_defaults(str(model), str(turns)).items():
                if data.get(name) is None:
                    data[name] = value
        return data

    @model_validator(mode="after")
    def _multi_turn_fits(self) -> RunConfig:
        if self.turns != "multi":
            return self
        if self.max_completion_tokens < MIN_MULTI_TURN_TOKENS:
            raise ValueError(
                f"max_completion_tokens ({self.max_completion_tokens}) must be at least "
                f"{MIN_MULTI_TURN_TOKENS} for a multi-turn run: every turn and tool result of a "
                "rollout share it (the multi-turn presets use 128)"
            )
        if self.supervision in SINGLE_TURN_MODES:
            raise ValueError(
                f"supervision {self.supervision} is single-turn only: a multi-turn run takes "
                "none, interleaved_sft or sft_then_rl (expert conversations between or before "
                "RL)"
            )
        return self

    @model_validator(mode="after")
    def _derive_name(self) -> RunConfig:
        if not self.name.strip():
            listing = f"{TOOL_COUNT} tools" if self.variant == "leaky" else f"top-{self.k}"
            method = "" if self.supervision == "none" else f" + {self.supervision}"
            turns = "multi-turn " if self.turns == "multi" else ""
            self.name = f"{turns}{self.variant} ({listing}){method} seed {self.seed}"
        return self

    def run_columns(self) -> dict[str, Any]:
        """The run row's columns (store.create_run keywords) for this config."""
        return {
            "name": self.name,
            "model": self.model,
            "total_steps": self.steps,
            "group_size": self.group_size,
            "prompts_per_step": self.prompts_per_step,
            "seed": self.seed,
            "variant": self.variant,
            "k": self.k if self.variant == "patched" else None,
            "config": self.model_dump(mode="json"),
            "keep_tokens_every": self.keep_tokens_every,
        }

    @property
    def listed_tools(self) -> int:
        """How many tools each prompt lists."""
        return TOOL_COUNT if self.variant == "leaky" else self.k
