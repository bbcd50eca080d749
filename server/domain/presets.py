"""Presets: named starting points for a launch (the form and `POST /api/runs` offer them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

COLLAPSE_LR = 1e-3  # the collapse study's too-high learning rate (bench/collapse.py)
# The collapse study's recipe: every supervisory preset reproduces bench/collapse.py's run of it.
COLLAPSE_RECIPE = {
    "variant": "patched",
    "steps": 300,
    "learning_rate": COLLAPSE_LR,
    "eval_every": 25,
}


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
            "Every prompt lists all 64 tools: true accuracy swings and the group disagrees.",
            base={"variant": "leaky"},
        ),
        Preset(
            "patched",
            "Patched (4-tool shortlist)",
            "Prompts list the top-4 tools by retrieval: converges in about 25 steps.",
            base={"variant": "patched", "k": 4},
        ),
        Preset(
            "leaky_vs_patched",
            "Leaky vs patched",
            "Both variants with the same seed and recipe, opened side by side.",
            base={"variant": "patched", "k": 4},
            runs=({"variant": "leaky"}, {"variant": "patched"}),
            varies=("variant",),
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
    ("Tool listing", "", ("leaky", "patched", "leaky_vs_patched")),
    (
        "Collapse study",
        "300 steps at learning rate 1e-3, evaluated every 25 steps, as bench/collapse.py.",
        ("collapse", "offpolicy", "hint", "interleaved_sft", "sft_then_rl"),
    ),
    ("Sweeps", "", ("lr_sweep",)),
)
