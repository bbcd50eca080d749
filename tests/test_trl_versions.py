"""A TRL user's GRPO script trains with the oldest and the newest TRL that pyproject.toml admits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

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

SCRIPT = Path(__file__).resolve().parent / "scripts" / "user_grpo.py"


@pytest.fixture(scope="session")
def venvs_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trl-venvs")


@pytest.mark.slow
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_user_script_trains(version: str, venvs_base: Path, tmp_path: Path) -> None:
    venv = venv_with_trl(version, venvs_base)
    print(f"venv for trl {version}: {venv} (built in {build_seconds(venv):.0f} s)")
    workdir = tmp_path / "work"  # an unrelated folder: nothing of the checkout beside the script
    workdir.mkdir()
    found = subprocess.run(
        [str(python(venv)), "-c", "import rollout_lens; print(rollout_lens.__file__)"],
        cwd=workdir,
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(found.stdout.strip()).is_relative_to(ROOT), "the venv must run this checkout"
    out = tmp_path / "out"
    db = f"sqlite:///{tmp_path / 'rollout-lens.db'}"
    done = subprocess.run(
        [
            str(python(venv)),
            str(SCRIPT),
            "--db",
            db,
            "--model",
            str(tmp_path / "model"),
            "--out",
            str(out),
        ],
        cwd=workdir,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads((out / "result.json").read_text())
    assert result["versions"]["trl"] == version
    expected_transformers = PINS[version].get("transformers")
    if expected_transformers:
        assert result["versions"]["transformers"] == expected_transformers
    assert result["versions"]["torch"].startswith("2.13.0")
    assert result["global_step"] == 4
    assert result["logged_steps"] == [2, 4]
    assert {"rewards/says_the_color/mean", "rewards/is_short/mean"} <= set(result["reward_keys"])
    # CALLBACK: once RolloutLensCallback is in the script, assert what it recorded in `db`.
