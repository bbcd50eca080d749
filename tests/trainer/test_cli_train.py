"""`rollout-lens train` as a user runs it (a subprocess): a real run of the tiny model into the
folder's SQLite file, then listed and exported by the same command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.web.test_cli import _cli

EXPORT_KEYS = {
    "run_id",
    "step",
    "group",
    "index",
    "prompt",
    "completion",
    "vote",
    "target",
    "verifier_reward",
    "true_score",
    "advantage",
    "sum_logprob",
    "format_valid",
    "token_logprobs",
    "control_token_probs",
}


@pytest.mark.slow
def test_train_runs_and_export(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {
        "ROLLOUT_LENS_DATA_DIR": str(tmp_path / "data"),
        "ROLLOUT_LENS_MODEL_CACHE_DIR": str(tiny_model_dir.parent),
    }
    done = _cli(
        ["train", "--variant", "patched", "--steps", "2", "--seed", "5", "--group-size", "4"], env
    )
    assert done.returncode == 0, done.stderr
    assert "run_id=1" in done.stdout and "rollout-lens.db" in done.stdout

    listed = _cli(["runs", "--format", "json"], env)
    runs = json.loads(listed.stdout)
    assert [(r["id"], r["status"], r["current_step"], r["group_size"]) for r in runs] == [
        (1, "completed", 2, 4)
    ]
    assert "completed" in _cli(["runs"], env).stdout

    out = tmp_path / "run1.jsonl"
    exported = _cli(["export", "1", "--format", "jsonl", "--output", str(out)], env)
    assert exported.returncode == 0, exported.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["kind"] == "run" and records[-1] == {"kind": "end", "steps": 2, "rollouts": 8}
    lines = [r for r in records if r["kind"] == "rollout"]
    assert len(lines) == 2 * 4
    assert all(set(line) >= EXPORT_KEYS for line in lines)
    assert [(x["step"], x["index"]) for x in lines] == [(s, i) for s in (1, 2) for i in range(4)]
    first = lines[0]
    assert set(first["control_token_probs"]) == {"<tool>", "</tool>", "</assistant>"}
    assert len(first["token_logprobs"]) == len(first["control_token_probs"]["<tool>"])
