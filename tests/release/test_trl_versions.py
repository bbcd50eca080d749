"""A TRL user's GRPO script trains with the oldest and the newest TRL that pyproject.toml admits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests import user_script as us
from tests.factories import load_run
from tests.trl_versions import (
    NEWEST,
    OLDEST,
    PINS,
    ROOT,
    build_seconds,
    clean_env,
    python,
    venv_with_trl,
)


@pytest.fixture(scope="session")
def venvs_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trl-venvs")


@pytest.mark.slow
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_callback_records_with_oldest_and_newest_trl(
    version: str, venvs_base: Path, tmp_path: Path
) -> None:
    """The user script with the one-line callback, run in a venv with that TRL: every rollout its
    reward function saw is recorded once, in its group, at its step."""
    venv = venv_with_trl(version, venvs_base)
    print(f"venv for trl {version}: {venv} (built in {build_seconds(venv):.0f} s)")
    folder = us.project_folder(tmp_path / "project")
    found = subprocess.run(
        [str(python(venv)), "-c", _VERSIONS],
        cwd=folder,
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    versions = json.loads(found.stdout)
    assert Path(versions["rollout_lens"]).is_relative_to(ROOT), "the venv must run this checkout"
    assert versions["trl"] == version and versions["torch"].startswith("2.13.0")
    if PINS[version].get("transformers"):
        assert versions["transformers"] == PINS[version]["transformers"]
    out = tmp_path / "out"
    out.mkdir()
    db = f"sqlite:///{tmp_path / 'rollout-lens.db'}"
    done = subprocess.run(
        [str(python(venv)), "user_grpo.py", "--db", db, "--model", str(tmp_path / "model")]
        + ["--out", str(out), "--steps", "4", "--logging-steps", "2", "--iterations", "2"],
        cwd=folder,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    seen = [json.loads(line) for line in (out / "seen-0.jsonl").read_text().splitlines()]
    run, rows, steps, series = load_run(db, 1)
    assert run.source == "callback" and run.status == "completed"
    assert [s.step for s in steps] == [1, 2, 3, 4]
    assert [s.rollout_step for s in steps] == [1, 1, 3, 3]  # num_iterations=2
    assert [s.loss is not None for s in steps] == [False, True, False, True]  # logging_steps=2
    assert len(rows) == len(seen) == 2 * 8
    ordered = sorted(rows, key=lambda r: (r["step"], r["group"], r["index"]))
    assert [r["completion"] for r in ordered] == [s["completion"] for s in seen]
    for r in rows:
        assert set(r["meta"]["rewards"]) == {"says_the_color", "is_short"}
        assert len(r["token_logprobs"]) == len(r["completion_ids"])


_VERSIONS = """
import json, rollout_lens, torch, transformers, trl
print(json.dumps({"rollout_lens": rollout_lens.__file__, "torch": torch.__version__,
                  "transformers": transformers.__version__, "trl": trl.__version__}))
"""
