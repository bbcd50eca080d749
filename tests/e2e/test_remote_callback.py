"""A user's TRL script recording into a dashboard in another process (`rollout-lens serve`) over
HTTP with a recording token, through ROLLOUT_LENS_URL and ROLLOUT_LENS_TOKEN alone: the
dashboard is killed (SIGKILL) mid-run and started again; every step arrives once, in order,
matching what the script's reward function saw, and nothing is written in the script's folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests import user_script as us
from tests.factories import load_run
from tests.web_support import free_port, loopback

pytestmark = pytest.mark.slow

RECORDER = "record-token-0123456789abcdef"
FULL = "full-token-0123456789abcdef"


def _serve(port: int, data: Path, db: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    env |= {
        "ROLLOUT_LENS_DATA_DIR": str(data),
        "ROLLOUT_LENS_DATABASE_URL": db,
        "ROLLOUT_LENS_AUTH_TOKEN": FULL,
        "ROLLOUT_LENS_RECORD_TOKEN": RECORDER,
        # a broker named: `serve` starts no local worker (nothing here launches runs)
        "ROLLOUT_LENS_BROKER_URL": os.environ.get(
            "ROLLOUT_LENS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"
        ),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout_lens", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            if loopback("GET", f"http://127.0.0.1:{port}/api/runs", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "serve did not start"
        time.sleep(0.2)


def test_a_script_records_into_a_dashboard_killed_and_restarted_mid_run(
    user_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    db = f"sqlite:///{tmp_path / 'dashboard.db'}"
    dashboard = _serve(port, tmp_path / "dashboard", db)
    folder = us.project_folder(tmp_path / "project")
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    env.pop("PYTHONPATH", None)
    env |= {
        "ROLLOUT_LENS_URL": f"http://127.0.0.1:{port}",
        "ROLLOUT_LENS_TOKEN": RECORDER,
        "ROLLOUT_LENS_HEARTBEAT_SECONDS": "0.5",
    }
    script = subprocess.Popen(
        [sys.executable, "user_grpo.py", "--model", str(user_model_dir), "--out", str(out)]
        + ["--steps", "8", "--step-sleep", "0.6"],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not _steps(port):  # wait for the first recorded step
            assert script.poll() is None and time.monotonic() < deadline, script.stdout
            time.sleep(0.2)
        dashboard.send_signal(signal.SIGKILL)
        dashboard.wait()
        time.sleep(2.0)  # the script trains on and buffers
        dashboard = _serve(port, tmp_path / "dashboard", db)
        output, _ = script.communicate(timeout=600)
    finally:
        if script.poll() is None:
            script.kill()
        dashboard.terminate()
        dashboard.wait(timeout=30)
    assert script.returncode == 0, output
    assert "the dashboard is unreachable" in output and "the dashboard is back" in output
    assert not (folder / ".rollout-lens").exists()  # nothing written locally
    from rollout_lens.server import store
    from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope

    engine = make_engine(db)
    with session_scope(make_session_factory(engine)) as session:
        runs = store.list_runs(session)
    engine.dispose()
    assert len(runs) == 1
    run, rows, steps, _ = load_run(db, runs[0].id)
    assert run.status == "completed" and run.source == "callback"
    assert [s.step for s in steps] == list(range(1, 9))
    assert run.dropped_steps == 0 and run.dropped_rollouts == 0
    seen = [json.loads(line) for line in (out / "seen-0.jsonl").read_text().splitlines()]
    ordered = sorted(rows, key=lambda r: (r["step"], r["group"], r["index"]))
    assert [r["completion"] for r in ordered] == [us._text(s["completion"]) for s in seen]
    assert all(len(r["completion_ids"]) == len(r["token_logprobs"]) for r in rows)


def _steps(port: int) -> int:
    try:
        runs = loopback(
            "GET",
            f"http://127.0.0.1:{port}/api/runs",
            headers={"authorization": f"Bearer {FULL}"},
            timeout=2,
        ).json()["runs"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return max((int(r.get("current_step") or 0) for r in runs), default=0)
