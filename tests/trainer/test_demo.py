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

from rollout_lens.cli.demo import compare_url

ROOT = Path(__file__).resolve().parents[2]
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


def _demo_output(proc: subprocess.Popen[str], log: Path, wanted: re.Pattern[str]) -> str:
    """The demo's output once `wanted` appears in it (10 minutes is a hang, not load)."""
    deadline = time.monotonic() + 600
    while not wanted.search(text := log.read_text()):
        assert proc.poll() is None, f"demo exited: {text}"
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    return text


@pytest.mark.slow
def test_demo_trains_a_leaky_and_a_patched_run_and_serves_their_comparison(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """One demo, as a user runs it: two runs trained, what they recorded said, the compare page
    served at the URL it prints, and its local worker gone once it stops."""
    env = _env(tmp_path / "data", tiny_model_dir.parent)
    port = _free_port()
    log = tmp_path / "demo.log"
    with (
        log.open("w") as out,
        subprocess.Popen(
            [sys.executable, "-m", "rollout_lens", "demo", "--steps", "2", "--port", str(port)],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        ) as proc,
    ):
        try:
            output = _demo_output(proc, log, URL)
            match = URL.search(output)
            assert match and match.group(1) == f"http://127.0.0.1:{port}/compare?runs=1,2"
            with urllib.request.urlopen(match.group(1), timeout=30) as response:
                status, body = response.status, response.read().decode()
            assert status == 200 and "leaky (64 tools)" in body and "patched (top-4)" in body
            listed = subprocess.run(
                [sys.executable, "-m", "rollout_lens", "runs", "--format", "json"],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                check=True,
            )
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert "Training 2 runs of 2 steps" in output
    assert re.search(r"leaky 2/2 .*\(completed\) \| patched 2/2 .*\(completed\)", output)
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
        assert said in output, (said, output)
    worker = re.search(r"started a local worker, pid (\d+)", log.read_text())
    assert worker, log.read_text()
    with pytest.raises(ProcessLookupError):
        os.kill(int(worker.group(1)), 0)


@pytest.mark.slow
def test_no_serve_does_not_look_at_the_port(tmp_path: Path, tiny_model_dir: Path) -> None:
    """--no-serve serves nothing: a busy port is no reason to stop. It trains (stopped here once
    it starts: the test above checks what training gives)."""
    log = tmp_path / "demo.log"
    with socket.socket() as busy, log.open("w") as out:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        with subprocess.Popen(
            [sys.executable, "-m", "rollout_lens", "demo", "--no-serve", "--steps", "2"]
            + ["--port", port],
            env=_env(tmp_path / "data", tiny_model_dir.parent),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        ) as proc:
            try:
                output = _demo_output(proc, log, re.compile("Training 2 runs of 2 steps"))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    assert "already in use" not in output
