"""The real presets' texts and the real-model page state what the recorded runs recorded: their
figures are read back from docs/benchmarks/real-model.json (bench/real_model.py report --json,
the runs' curves as the store held them) through the bench's own summary (bench/real_model_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

from rollout_lens.server.core.presets import PRESETS, REAL_FIGURES

from bench.real_model_report import markdown, preset_figures, summary

ROOT = Path(__file__).resolve().parents[2]
RUNS = json.loads((ROOT / "docs" / "benchmarks" / "real-model.json").read_text())


def test_the_presets_figures_are_the_recorded_runs() -> None:
    assert preset_figures(RUNS) == REAL_FIGURES


def test_the_presets_texts_state_those_figures() -> None:
    text = PRESETS["real_patched"].description
    for name in ("warmup_first5", "warmup_last10"):
        assert f"{REAL_FIGURES[name]:.2f}" in text, name
    assert f"{REAL_FIGURES['plain_formatted']} of {REAL_FIGURES['plain_rollouts']}" in text
    assert f"{REAL_FIGURES['warmup_step_seconds']} s" in text
    pair = PRESETS["real_leaky_vs_patched"].description
    for name in ("leaky_first5", "leaky_last10", "warmup_first5", "warmup_last10"):
        assert f"{REAL_FIGURES[name]:.2f}" in pair, name
    assert f"{REAL_FIGURES['leaky_right']} of {REAL_FIGURES['leaky_rollouts']}" in pair
    assert f"{REAL_FIGURES['leaky_step_seconds']} s" in pair


def test_the_pages_tables_are_the_recorded_runs() -> None:
    for run in RUNS:
        run["summary"] = summary(run)
    page = (ROOT / "docs" / "benchmarks" / "real-model.md").read_text()
    assert markdown(RUNS) in page
