"""Stop means stop, for real: a user's TRL script recording into a dashboard over HTTP (through
ROLLOUT_LENS_URL and a recording token alone) is cancelled from the dashboard's API mid-run;
its training stops the way TRL stops (before max_steps, the script ending normally), the run is
`cancelled` with nothing recorded after the cancel, and its page says who stopped it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.webapp.app import create_app
from rollout_lens.server.webapp.http.security import token_name

from tests import user_script as us
from tests.factories import load_run
from tests.web_support import free_port, loopback, parse, serve_app

pytestmark = pytest.mark.slow

FULL = "full-token-0123456789abcdef"
RECORDER = "record-token-0123456789abcdef"
MAX_STEPS = 40  # far more than it trains: the cancel lands after step 2
BATCH = 8  # completions a step (per_device_train_batch_size): its reward function sees each once


@pytest.fixture
def dashboard(tmp_path: Path, migrated_sqlite) -> Iterator[tuple[str, str]]:  # type: ignore[no-untyped-def]
    url = migrated_sqlite(tmp_path / "dashboard.db")
    engine = make_engine(url)
    settings = Settings(
        database_url=url, data_dir=tmp_path / "data", auth_token=FULL, record_token=RECORDER
    )
    with serve_app(create_app(settings, session_factory=make_session_factory(engine))) as base:
        yield base, url
    engine.dispose()


def _run(base: str) -> dict | None:  # type: ignore[type-arg]
    headers = {"authorization": f"Bearer {FULL}"}
    runs = loopback("GET", f"{base}/api/runs", headers=headers, timeout=10).json()["runs"]
    return runs[0] if runs else None


def _cancel_at_step_2(base: str, script: subprocess.Popen[str]) -> dict:  # type: ignore[type-arg]
    """Wait for the script's run to record step 2, then cancel it with the access token, as an
    admin does from the API; the run as it was listed."""
    deadline = time.monotonic() + 300
    while (run := _run(base)) is None or run["current_step"] < 2:
        assert script.poll() is None and time.monotonic() < deadline, script.stdout
        time.sleep(0.1)
    cancel = loopback(
        "POST",
        f"{base}/api/runs/{run['id']}/cancel",
        headers={"authorization": f"Bearer {FULL}"},
        timeout=30,
    )
    assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled", cancel.text
    return run


def test_a_script_cancelled_from_the_dashboard_stops_training(
    user_model_dir: Path, tmp_path: Path, dashboard: tuple[str, str]
) -> None:
    base, db = dashboard
    folder = us.project_folder(tmp_path / "project")
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    env.pop("PYTHONPATH", None)
    env |= {
        "ROLLOUT_LENS_URL": base,
        "ROLLOUT_LENS_TOKEN": RECORDER,
        "ROLLOUT_LENS_HEARTBEAT_SECONDS": "0.5",
    }
    script = subprocess.Popen(
        [sys.executable, "user_grpo.py", "--model", str(user_model_dir), "--out", str(out)]
        + ["--steps", str(MAX_STEPS), "--batch", str(BATCH), "--step-sleep", "0.3"],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run = _cancel_at_step_2(base, script)
        at_cancel = loopback("GET", f"{base}/api/runs/{run['id']}", timeout=10).json()["last_step"]
        output, _ = script.communicate(timeout=300)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == 0, output
    who = token_name(FULL)
    assert f"the dashboard cancelled run {run['id']} (by {who}): training stops" in output
    # TRL stopped the loop: the reward function saw fewer steps than max_steps
    seen = (out / "seen-0.jsonl").read_text().splitlines()
    trained = len(seen) // BATCH
    assert at_cancel <= trained < MAX_STEPS, (at_cancel, trained)
    recorded, rows, steps, _ = load_run(db, run["id"])
    assert recorded.status == "cancelled" and recorded.ended_by == f"dashboard ({who})"
    assert [s.step for s in steps] == list(range(1, at_cancel + 1))  # nothing after the cancel
    first = [json.loads(line)["completion"] for line in seen[: len(rows)]]
    ordered = sorted(rows, key=lambda r: (r["step"], r["group"], r["index"]))
    assert [r["completion"] for r in ordered] == [us._text(c) for c in first]
    page = parse(loopback("GET", f"{base}/runs/{run['id']}", timeout=10).text)
    assert page.find("dd", data_field="ended_by").text == f"dashboard ({who})"
    assert page.find("span", cls="badge", data_status="cancelled").text == "cancelled"


def test_a_distributed_script_recording_locally_stops_on_every_process(
    user_model_dir: Path, tmp_path: Path, dashboard: tuple[str, str]
) -> None:
    """Two processes (accelerate, gloo) recording straight into the dashboard's database: the
    main one's writer hears the cancel, and the callback hands the answer to the other process,
    which would otherwise wait forever for its partner's next gradient."""
    base, db = dashboard
    folder = us.project_folder(tmp_path / "project")
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    env.pop("PYTHONPATH", None)
    env |= {"ROLLOUT_LENS_HEARTBEAT_SECONDS": "0.5"}
    accelerate = Path(sys.executable).parent / "accelerate"
    script = subprocess.Popen(
        [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
        + ["--mixed_precision", "no", "--dynamo_backend", "no"]
        + ["--main_process_port", str(free_port())]
        + ["user_grpo.py", "--model", str(user_model_dir), "--out", str(out), "--db", db]
        + ["--steps", str(MAX_STEPS), "--batch", "2", "--step-sleep", "0.3"],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run = _cancel_at_step_2(base, script)
        output, _ = script.communicate(timeout=300)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == 0, output[-3000:]
    assert f"the dashboard cancelled run {run['id']} (by {token_name(FULL)})" in output
    per_rank = [len((out / f"seen-{rank}.jsonl").read_text().splitlines()) // 2 for rank in (0, 1)]
    assert per_rank[0] == per_rank[1] < MAX_STEPS, per_rank  # both stopped, at the same step
    recorded, _, steps, _ = load_run(db, run["id"])
    assert recorded.status == "cancelled" and len(steps) <= per_rank[0]
