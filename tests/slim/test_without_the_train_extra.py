"""The dashboard where the train extra is not installed (`make test`'s second venv, the `test`
extra alone): every module of the dashboard, the CLI and the client imports without the ML stack,
the dashboard serves a recorded run's pages, and what needs the ML stack says so and creates
nothing. The import check runs in every venv; the tests of the extra's absence skip where it is
installed (the full venv runs the rest of the suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.webapp.app import create_app

from tests.conftest import ML_STACK, TRAIN_EXTRA
from tests.factories import make_run
from tests.web_support import client_for, launch_fails_saying_why, parse, serve_app

ROOT = Path(__file__).resolve().parents[2]
absent = pytest.mark.skipif(TRAIN_EXTRA, reason="the train extra is installed here")


def _dashboard_modules() -> list[str]:
    """Every module of the dashboard (server/) and of the package's own CLI and client."""
    names = []
    for path in sorted((ROOT / "server").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names.append(".".join(("rollout_lens", *parts)))
    for path in sorted((ROOT / "rollout_lens").rglob("*.py")):  # the CLI is a package
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names.append(".".join(parts))
    return names


def test_every_dashboard_module_imports_without_the_ml_stack() -> None:
    modules = _dashboard_modules()
    assert "rollout_lens.server.webapp.app" in modules and "rollout_lens.cli" in modules
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(json.dumps([m for m in {ML_STACK!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [], "the dashboard loaded the ML stack"


def test_a_recorded_run_reads_on_every_page(
    tmp_path: Path, migrated_sqlite: Callable[[Path], str]
) -> None:
    factory = make_session_factory(make_engine(migrated_sqlite(tmp_path / "lens.db")))
    run_id = make_run(factory, steps=2, name="slim")
    other = make_run(factory, steps=2, name="other", seed=1)
    client = client_for(factory, data_dir=tmp_path)
    pages = ("", f"runs/{run_id}", f"runs/{run_id}/steps/2", f"runs/{run_id}/steps/2/groups/0")
    for path in (
        f"/{p}" for p in (*pages, f"runs/{run_id}/rollouts", f"compare?runs={run_id},{other}")
    ):
        response = client.get(path)
        assert response.status_code == 200, path
        assert parse(response.text).find("title").text, path
    group = client.get(f"/api/runs/{run_id}/steps/2/groups/0").json()
    assert len(group["rollouts"]) == 8 and all(r["completion"] for r in group["rollouts"])


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    return subprocess.run(
        [sys.executable, "-m", "rollout_lens", *args],
        env=env | {"ROLLOUT_LENS_DATA_DIR": str(tmp_path / "data")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


@absent
def test_what_trains_names_the_install_and_creates_nothing(tmp_path: Path) -> None:
    for args in (["demo", "--no-serve"], ["build-model", "--real"], ["train", "--steps", "1"]):
        done = _cli(tmp_path, *args)
        assert done.returncode != 0, (args, done.stdout)
        assert "train" in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
    assert not (tmp_path / "data" / "models").exists()


@absent
def test_a_launched_run_fails_saying_what_to_install(tmp_path: Path) -> None:
    """The embedded worker of a dashboard-only install cannot train: the run ends `failed`, and
    its error names the install to make."""
    from rollout_lens.server.store.migrate import upgrade

    settings = Settings(data_dir=tmp_path)
    upgrade(make_engine(settings.database_url))
    log = tmp_path / "worker.log"
    with serve_app(create_app(settings)) as base, log.open("w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "rollout_lens", "worker"],
            env={k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
            | {"ROLLOUT_LENS_DATA_DIR": str(tmp_path)},
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            launch_fails_saying_why(base, log)
        finally:
            worker.terminate()
            worker.wait(timeout=30)
