"""`rollout-lens demo`: two short runs, leaky and patched, and the URL that compares them."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rollout_lens.demo import compare_url

ROOT = Path(__file__).resolve().parent.parent
URL = re.compile(r"Compare them at (http://\S+/compare\?runs=(\d+),(\d+))")


def _env(data_dir: Path, models: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    return env | {
        "PYTHONPATH": str(ROOT),
        "ROLLOUT_LENS_DATA_DIR": str(data_dir),
        "ROLLOUT_LENS_MODEL_CACHE_DIR": str(models),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_compare_url_names_the_runs_and_a_reachable_host() -> None:
    assert compare_url("127.0.0.1", 8000, [3, 4]) == "http://127.0.0.1:8000/compare?runs=3,4"
    assert compare_url("0.0.0.0", 80, [1, 2]) == "http://127.0.0.1:80/compare?runs=1,2"
    assert compare_url("::1", 8001, [1, 2]) == "http://[::1]:8001/compare?runs=1,2"


def test_demo_refuses_bad_steps_before_creating_anything(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rollout_lens", "demo", "--no-serve", "--steps", "0"],
        env=_env(tmp_path / "data", tmp_path / "models"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "steps" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
def test_demo_trains_a_leaky_and_a_patched_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    env = _env(tmp_path / "data", tiny_model_dir.parent)
    with socket.socket() as busy:  # --no-serve serves nothing: a busy port is no reason to stop
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        done = subprocess.run(
            [sys.executable, "-m", "rollout_lens", "demo", "--no-serve", "--steps", "2"]
            + ["--port", port],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Training 2 runs of 2 steps" in done.stdout
    assert re.search(r"leaky 2/2 .*\(completed\) \| patched 2/2 .*\(completed\)", done.stdout)
    match = URL.search(done.stdout)
    assert match, done.stdout
    assert match.group(1).startswith(f"http://127.0.0.1:{port}/compare?runs=")

    listed = subprocess.run(
        [sys.executable, "-m", "rollout_lens", "runs", "--format", "json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    runs = {r["id"]: r for r in json.loads(listed.stdout)}
    named = [int(match.group(2)), int(match.group(3))]
    assert sorted(runs) == sorted(named)
    assert [runs[i]["variant"] for i in named] == ["leaky", "patched"]
    assert all(runs[i]["status"] == "completed" and runs[i]["current_step"] == 2 for i in named)
    assert runs[named[1]]["k"] == 4 and runs[named[0]]["k"] is None
    assert runs[named[0]]["seed"] == runs[named[1]]["seed"]
    # What the demo says its runs show are the figures they recorded.
    for run_id in named:
        run = runs[run_id]
        said = (
            f"{run['variant']}: true accuracy {run['recent_true_accuracy']:.2f}, verifier reward "
            f"{run['recent_reward']:.2f} over its last 2 steps"
        )
        assert said in done.stdout, (said, done.stdout)


@pytest.mark.slow
def test_demo_serves_the_compare_page(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = _free_port()
    log = tmp_path / "demo.log"
    with (
        log.open("w") as out,
        subprocess.Popen(
            [sys.executable, "-m", "rollout_lens", "demo", "--steps", "1", "--port", str(port)],
            env=_env(tmp_path / "data", tiny_model_dir.parent),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        ) as proc,
    ):
        try:
            body, status, deadline = "", 0, time.monotonic() + 300
            while not status and time.monotonic() < deadline:
                assert proc.poll() is None, f"demo exited: {log.read_text()}"
                match = URL.search(log.read_text())
                if match:
                    try:
                        with urllib.request.urlopen(match.group(1), timeout=2) as response:
                            status, body = response.status, response.read().decode()
                    except OSError:
                        pass
                time.sleep(0.2)
            assert status == 200, log.read_text()
            assert match and match.group(1) == f"http://127.0.0.1:{port}/compare?runs=1,2"
            assert "leaky (64 tools)" in body and "patched (top-4)" in body
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    worker = re.search(r"started a local worker, pid (\d+)", log.read_text())
    assert worker, log.read_text()
    with pytest.raises(ProcessLookupError):
        os.kill(int(worker.group(1)), 0)


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_demo_stopped_while_starting_leaves_no_run_queued(
    tmp_path: Path, tiny_model_dir: Path, stop: str
) -> None:
    """Stopped while its runs' processes load torch, the demo ends each run `cancelled` with the
    reason, not "queued · starting" for good."""
    import signal
    import sqlite3

    data = tmp_path / "data"
    with subprocess.Popen(
        [sys.executable, "-m", "rollout_lens", "demo", "--no-serve", "--steps", "3"],
        env=_env(data, tiny_model_dir.parent),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a process group of its own, as a terminal's Ctrl-C sees it
    ) as proc:
        deadline = time.monotonic() + 120
        starting: list[tuple[int, str, str | None]] = []
        while not starting and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                with sqlite3.connect(data / "rollout-lens.db") as db:
                    starting = db.execute(
                        "SELECT id, status, phase FROM runs WHERE phase IS NOT NULL"
                    ).fetchall()
            except sqlite3.OperationalError:  # not created or not migrated yet
                pass
            time.sleep(0.05)
        assert starting and all(status == "queued" for _, status, _ in starting), starting
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    with sqlite3.connect(data / "rollout-lens.db") as db:
        runs = db.execute("SELECT id, status, error FROM runs ORDER BY id").fetchall()
    assert len(runs) == 2, out
    for _, status, error in runs:
        assert status == "cancelled", (runs, out)
        assert error and ("the demo was stopped" in error or error == "interrupted"), runs
