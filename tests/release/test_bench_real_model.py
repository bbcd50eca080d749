"""bench/real_model.py's grid and report on the tiny model's preset, briefly, so that they keep
running: the grid launches its children at once on one new database (it migrates it first) and
times their stages; the report reads every run back with its curves and stage costs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "real_model.py"


def test_the_grid_trains_each_method_and_the_report_reads_them(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    env = os.environ | {"ROLLOUT_LENS_MODEL_CACHE_DIR": str(tiny_model_dir.parent)}
    data = tmp_path / "grid"
    grid = [sys.executable, str(BENCH), "grid", "--data-dir", str(data), "--preset", "patched"]
    grid += ["--methods", "none", "offpolicy", "--seeds", "3", "--steps", "2", "--jobs", "2"]
    subprocess.run(grid, env=env, check=True, timeout=600)
    for stem in ("patched-none-seed3", "patched-offpolicy-seed3"):
        log = (data / "logs" / f"{stem}.log").read_text()
        assert "done" in log, log[-2000:]
    out = tmp_path / "runs.json"
    report = [sys.executable, str(BENCH), "report", "--data-dir", str(data), "--json", str(out)]
    printed = subprocess.run(report, env=env, check=True, capture_output=True, text=True).stdout
    runs = json.loads(out.read_text())
    assert sorted(r["method"] for r in runs) == ["none", "offpolicy"]
    for run in runs:
        assert run["status"] == "completed" and run["steps"] == [1, 2] and run["seed"] == 3
        assert len(run["true_accuracy"]) == len(run["format_valid"]) == 2
        medians = run["summary"]["stage_medians"]
        assert medians["wall"] > 0 and medians["generation"] > 0 and medians["backward"] > 0
    assert "median seconds a step: wall" in printed
