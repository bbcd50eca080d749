"""A user's TRL script that checkpoints every 2 steps dies (SIGKILL) at the end of step 4, after
its checkpoint at step 2 and with step 3 recorded, and is run again with
`trainer.train(resume_from_checkpoint=True)`: over HTTP (a dashboard under uvicorn, a recording
token) and locally (its own SQLite file), the resumed script continues the run it started: one
run, every step once, completed, and the two recordings hold the same rollouts step by step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.webapp.app import create_app
from sqlalchemy.orm import Session, sessionmaker

from tests import user_script as us
from tests.factories import load_run
from tests.web_support import serve_app

pytestmark = pytest.mark.slow

RECORDER = "record-token-0123456789abcdef"
FULL = "full-token-0123456789abcdef"
STEPS, SAVE_EVERY, KILL_AT = 4, 2, 4


@pytest.fixture
def dashboard(session_factory: sessionmaker[Session]) -> Iterator[str]:
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    app = create_app(
        Settings(database_url=url, auth_token=FULL, record_token=RECORDER),
        session_factory=session_factory,
    )
    with serve_app(app) as base:
        yield base


def _start(folder: Path, out: Path, model: Path, env: dict[str, str], *extra: str) -> Any:
    out.mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "user_grpo.py", "--model", str(model), "--out", str(out)]
        + ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finished(process: Any) -> tuple[int, str]:
    output, _ = process.communicate(timeout=600)
    return process.returncode, output


def _by_step(database_url: str, run_id: int) -> tuple[Any, list[int], dict[int, Any]]:
    run, rows, steps, _ = load_run(database_url, run_id)
    rollouts: dict[int, list[tuple[Any, ...]]] = {}
    for r in rows:
        rollouts.setdefault(r["step"], []).append(
            (r["group"], r["index"], r["verifier_reward"], r["vote"], r["completion"])
        )
    return run, [s.step for s in steps], {s: sorted(v) for s, v in rollouts.items()}


def _only_run(database_url: str) -> int:
    engine = make_engine(database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            runs = store.list_runs(session)
    finally:
        engine.dispose()
    assert len(runs) == 1, [(r.id, r.name) for r in runs]
    return runs[0].id


def test_a_script_killed_and_resumed_from_its_checkpoint_continues_its_run(
    user_model_dir: Path,
    tmp_path: Path,
    dashboard: str,
    session_factory: sessionmaker[Session],
) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    base.pop("PYTHONPATH", None)
    base |= {"ROLLOUT_LENS_HEARTBEAT_SECONDS": "0.5"}
    remote_env = base | {"ROLLOUT_LENS_URL": dashboard, "ROLLOUT_LENS_TOKEN": RECORDER}
    local_db = f"sqlite:///{tmp_path / 'local.db'}"
    folders = {
        name: (us.project_folder(tmp_path / name), tmp_path / f"{name}-out")
        for name in ("remote", "local")
    }
    local = ("--db", local_db)
    remote_url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    # the two recordings side by side: each dies, then each resumes
    for extra in (("--kill-at", str(KILL_AT)), ("--resume", "--restore-callbacks")):
        remote_extra = extra
        local_extra = tuple(a for a in extra if a != "--restore-callbacks")
        processes = [
            _start(*folders["remote"], user_model_dir, remote_env, *remote_extra),
            _start(*folders["local"], user_model_dir, base, *local, *local_extra),
        ]
        ended = [_finished(p) for p in processes]
        want = -signal.SIGKILL if "--kill-at" in extra else 0
        for code, output in ended:
            assert code == want, output[-3000:]
        if want:
            for _, out in folders.values():
                assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
            for name, url, (_, output) in zip(
                ("remote", "local"), (remote_url, local_db), ended, strict=True
            ):
                dead = _by_step(url, _only_run(url))  # step 3 is replaced
                assert dead[0].status == "running" and dead[1] == [1, 2, 3], (name, output[-3000:])
    remote_run, remote_steps, remote_rollouts = _by_step(remote_url, _only_run(remote_url))
    local_run, local_steps, local_rollouts = _by_step(local_db, _only_run(local_db))
    for name, run, steps in (
        ("remote", remote_run, remote_steps),
        ("local", local_run, local_steps),
    ):
        assert run.status == "completed" and run.record_epoch == 1, (name, run.status, run.error)
        assert steps == list(range(1, STEPS + 1)), name
        assert run.dropped_steps == 0 and run.dropped_rollouts == 0, name
        assert run.current_step == STEPS
    assert sorted(remote_rollouts) == list(range(1, STEPS + 1))
    assert remote_rollouts == local_rollouts
    assert all(len(v) == 8 for v in remote_rollouts.values())  # batch 8: each rollout once
