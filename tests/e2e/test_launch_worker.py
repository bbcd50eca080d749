"""Launch, watch, cancel and resume end to end: the dashboard under uvicorn, a real Celery worker
process on real Redis training the real tiny model, and Debian's Chromium driving the pages.
Then the embedded default: `rollout-lens serve` with no broker trains a run with its own worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.models import RunRow
from rollout_lens.server.webapp.app import create_app, prepare_database
from sqlalchemy.orm import Session, sessionmaker

from tests import factories, web_support

playwright = pytest.importorskip("playwright.sync_api")
uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("ROLLOUT_LENS_TEST_LAUNCH_REDIS_URL", "redis://127.0.0.1:6379/14")
ARTIFACTS = Path(os.environ.get("ROLLOUT_LENS_TEST_ARTIFACTS") or ROOT / "test-artifacts")
TRAIN_TIMEOUT = 300  # seconds for a small run, worker start and model load included


def _env(tmp: Path, tiny_model_dir: Path, **extra: str) -> dict[str, str]:
    """The test's settings as the environment a worker or `serve` reads."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
    return (
        base
        | {
            "PYTHONPATH": str(ROOT),
            "ROLLOUT_LENS_DATA_DIR": str(tmp),
            "ROLLOUT_LENS_MODEL_CACHE_DIR": str(tiny_model_dir.parent),
            "ROLLOUT_LENS_HEARTBEAT_SECONDS": "0.5",
            "ROLLOUT_LENS_CHECKPOINT_EVERY": "5",
        }
        | extra
    )


def _json(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@dataclass
class Stack:
    """Dashboard + worker on one SQLite file and Redis DB 14."""

    url: str
    factory: sessionmaker[Session]
    worker: subprocess.Popen[bytes]
    log: Path
    seen: dict[str, list[str]] = field(default_factory=dict)

    def launch(self, **body: Any) -> list[dict[str, Any]]:
        status, data = _json("POST", f"{self.url}/api/runs", body)
        assert status == 201, data
        return list(data["runs"])

    def progress(self, run_id: int) -> dict[str, Any]:
        return dict(_json("GET", f"{self.url}/api/runs/{run_id}/progress")[1])

    def wait(
        self,
        run_id: int,
        what: str,
        done: Callable[[dict[str, Any]], bool],
        timeout: float = TRAIN_TIMEOUT,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = self.progress(run_id)
            if done(live):
                return live
            assert self.worker.poll() is None, f"the worker died:\n{self.log.read_text()[-4000:]}"
            time.sleep(0.25)
        pytest.fail(
            f"run {run_id} never {what}: {self.progress(run_id)}\n{self.log.read_text()[-4000:]}"
        )

    def steps(self, run_id: int) -> list[int]:
        return factories.recorded_steps(self.factory, run_id)

    def rollouts_per_step(self, run_id: int) -> dict[int, int]:
        return factories.rollouts_per_step(self.factory, run_id)

    def run(self, run_id: int) -> RunRow:
        with session_scope(self.factory) as session:
            return store.get_run(session, run_id=run_id)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    try:
        redis.Redis.from_url(REDIS_URL).flushdb()
    except redis.RedisError as exc:
        pytest.fail(f"Redis at {REDIS_URL} is needed: {exc}")
    tmp = tmp_path_factory.mktemp("launch")
    env = _env(tmp, tiny_model_dir, ROLLOUT_LENS_BROKER_URL=REDIS_URL)
    settings = Settings(
        data_dir=tmp,
        model_cache_dir=tiny_model_dir.parent,
        broker_url=REDIS_URL,
        checkpoint_every=5,
    )
    prepare_database(settings)
    engine = make_engine(settings.database_url)
    log = tmp / "worker.log"
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        worker = subprocess.Popen(
            [sys.executable, "-m", "rollout_lens", "worker"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    with web_support.serve_app(create_app(settings)) as base:
        yield Stack(base, make_session_factory(engine), worker, log)
    worker.terminate()
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
    engine.dispose()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from web_support.chromium_browser()


@pytest.fixture
def page(browser: Any, stack: Stack) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1440, "height": 900}, base_url=stack.url)
    context.set_default_timeout(15_000)
    errors: list[str] = []
    tab = context.new_page()
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    yield tab
    context.close()
    assert errors == []


def _badge(page: Any, scope: str = "#run-card") -> str:
    return str(page.locator(f"{scope} [data-field=status] .badge").inner_text())


@pytest.mark.redis
def _shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_serve_with_no_broker_trains_with_its_own_worker(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    port = web_support.free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with (
        log.open("wb") as out,
        subprocess.Popen(
            [sys.executable, "-m", "rollout_lens", "serve", "--port", str(port)],
            env=_env(tmp_path / "data", tiny_model_dir),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        ) as serve,
    ):
        try:
            deadline = time.monotonic() + 30
            status = None
            while status is None and time.monotonic() < deadline:
                try:
                    status, _ = _json("GET", f"{url}/api/runs")
                except OSError:
                    assert serve.poll() is None, log.read_text()
                    time.sleep(0.1)
            first_line = next(x for x in log.read_text().splitlines() if "Rollout Lens on" in x)
            assert "embedded queue; started a local worker" in first_line
            worker_pid = int(re.search(r"pid (\d+)", first_line).group(1))  # type: ignore[union-attr]
            created, body = _json("POST", f"{url}/api/runs", {"steps": 3, "seed": 26})
            assert created == 201, body
            run_id = body["runs"][0]["id"]
            deadline = time.monotonic() + TRAIN_TIMEOUT
            live = {}
            while time.monotonic() < deadline:
                live = _json("GET", f"{url}/api/runs/{run_id}/progress")[1]
                if live["status"] not in ("queued", "running"):
                    break
                time.sleep(0.5)
            assert live["status"] == "completed" and live["current_step"] == 3, log.read_text()[
                -4000:
            ]
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=60)
    with pytest.raises(ProcessLookupError):  # the worker child went with serve
        os.kill(worker_pid, 0)
