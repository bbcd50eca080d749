"""Runs trained by a real Celery worker process: Redis and the embedded filesystem broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.errors import BrokerUnavailable
from rollout_lens.server.core.queue import enqueue_run, make_celery
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunRow, StepRow
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from tests import factories
from tests.waiting import returns

REDIS_URL = os.environ.get("ROLLOUT_LENS_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
# The shared worker's own Redis database: a queue of its own, which the tests that start their
# own worker (on REDIS_URL) neither flush nor send it their runs through.
SHARED_REDIS_URL = REDIS_URL.rsplit("/", 1)[0] + "/13"

pytestmark = pytest.mark.slow


class Worker:
    """A `rollout-lens worker` subprocess with the test's settings."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("ab") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollout_lens", "worker", "--loglevel", "INFO"],
                env=os.environ | env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def harness(
    tmp_path: Path, tiny_model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[Harness]:
    broker = getattr(request, "param", REDIS_URL)
    h = Harness(tmp_path, tiny_model_dir, "" if broker == "embedded" else broker)
    yield h
    h.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Harness]:
    """One Redis-backed worker for the tests that neither kill it nor change its broker: a
    Celery worker takes one task after another, and each test's run is a run of its own (a
    worker started for each test imported the training stack again, ~8 s of CPU each)."""
    h = Harness(tmp_path_factory.mktemp("shared"), tiny_model_dir, SHARED_REDIS_URL)
    h.start_worker()
    yield h
    h.close()


class Harness:
    def __init__(self, tmp_path: Path, tiny_model_dir: Path, broker: str) -> None:
        """`broker`: a Redis URL (its database flushed first), or "" for the embedded one."""
        self.tmp = tmp_path
        self.env = {
            "ROLLOUT_LENS_DATA_DIR": str(tmp_path / "data"),
            "ROLLOUT_LENS_MODEL_CACHE_DIR": str(tiny_model_dir.parent),
            "ROLLOUT_LENS_HEARTBEAT_SECONDS": "0.5",
            "ROLLOUT_LENS_LOST_AFTER_SECONDS": "3",
            "ROLLOUT_LENS_CHECKPOINT_EVERY": "5",
            "ROLLOUT_LENS_BROKER_URL": broker,  # "": the embedded broker
        }
        if broker:
            redis.Redis.from_url(broker).flushdb()
        self.settings = Settings(
            **{k.removeprefix("ROLLOUT_LENS_").lower(): v for k, v in self.env.items()}
        )
        self.engine = make_engine(self.settings.database_url)
        upgrade(self.engine)
        self.factory = make_session_factory(self.engine)
        self.celery = make_celery(self.settings)
        self.workers: list[Worker] = []

    def start_worker(self) -> Worker:
        worker = Worker(self.env, self.tmp / f"worker{len(self.workers)}.log")
        self.workers.append(worker)
        return worker

    def launch(self, config: RunConfig, *, enqueue: bool = True) -> int:
        with session_scope(self.factory) as session:
            run_id = store.create_run(session, **config.run_columns()).id
        if enqueue:
            enqueue_run(self.celery, run_id=run_id)
        return run_id

    def run(self, run_id: int) -> RunRow:
        with session_scope(self.factory) as session:
            return store.get_run(session, run_id=run_id)

    def wait(
        self, what: str, predicate: Callable[[RunRow], bool], run_id: int, timeout: float = 240
    ) -> RunRow:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.run(run_id)
            if predicate(run):
                return run
            if self.workers and all(w.proc.poll() is not None for w in self.workers):
                break
            time.sleep(0.2)
        logs = "\n".join(w.log.read_text()[-3000:] for w in self.workers)
        pytest.fail(f"run {run_id} never {what}: status {self.run(run_id).status}\n{logs}")

    def recorded_steps(self, run_id: int) -> list[int]:
        return factories.recorded_steps(self.factory, run_id)

    def rollouts_per_step(self, run_id: int) -> dict[int, int]:
        return factories.rollouts_per_step(self.factory, run_id)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.engine.dispose()


@pytest.mark.redis
def test_worker_trains_a_launched_run_once(shared: Harness) -> None:
    harness = shared
    config = RunConfig(steps=6, seed=11)
    run_id = harness.launch(config)
    enqueue_run(harness.celery, run_id=run_id)  # a second delivery of the same run
    run = harness.wait("completed", lambda r: r.status == "completed", run_id)
    assert run.worker_host and run.device == "cpu" and run.task_id
    assert harness.recorded_steps(run_id) == list(range(1, 7))
    assert harness.rollouts_per_step(run_id) == {s: 8 for s in range(1, 7)}
    assert run.checkpoint_step == 6  # every 5 steps, and the last


@pytest.mark.redis
def test_cancel_a_running_run_keeps_its_steps(shared: Harness) -> None:
    harness = shared
    run_id = harness.launch(RunConfig(steps=2000, seed=12))
    harness.wait("started", lambda r: r.current_step >= 3, run_id)
    with session_scope(harness.factory) as session:
        assert store.request_cancel(session, run_id=run_id) == "running"
    run = harness.wait("cancelled", lambda r: r.status == "cancelled", run_id, timeout=60)
    steps = harness.recorded_steps(run_id)
    assert 3 <= len(steps) < 2000 and steps == list(range(1, len(steps) + 1))
    assert run.finished_at is not None
    assert run.ended_by == "dashboard"  # who asked, kept when its worker stopped it


@pytest.mark.redis
def test_cancel_a_queued_run(shared: Harness) -> None:
    harness, (worker,) = shared, shared.workers
    run_id = harness.launch(RunConfig(steps=5), enqueue=False)  # not sent yet: it stays queued
    with session_scope(harness.factory) as session:
        assert store.queue_position(session, run_id=run_id) == 1
        assert store.request_cancel(session, run_id=run_id) == "cancelled"
    enqueue_run(harness.celery, run_id=run_id)  # the worker must not train a cancelled run
    # Until the worker has taken the message and decided (trainer/worker/tasks.py logs the skip), not
    # a fixed 8 s: a worker that trained it instead would not log this and fail the wait.
    skipped = f"run {run_id} is cancelled, not queued: skipping this delivery"
    deadline = time.monotonic() + 120
    while skipped not in worker.log.read_text():
        assert worker.proc.poll() is None, worker.log.read_text()[-3000:]
        assert time.monotonic() < deadline, worker.log.read_text()[-3000:]
        time.sleep(0.2)
    assert harness.run(run_id).status == "cancelled" and harness.recorded_steps(run_id) == []
    assert harness.run(run_id).ended_by == "dashboard"


@pytest.mark.redis
def test_killed_worker_is_lost_then_resumed_without_gaps(harness: Harness) -> None:
    worker = harness.start_worker()
    config = RunConfig(steps=24, seed=13)  # half its steps left when it is killed
    run_id = harness.launch(config)
    harness.wait("passed its first checkpoint", lambda r: r.current_step >= 12, run_id)
    worker.kill()
    # Polled until its last heartbeat is over 3 s old (a fixed 3.5 s before): found lost then.
    deadline = time.monotonic() + 30
    lost_ids: list[int] = []
    while not lost_ids and time.monotonic() < deadline:
        time.sleep(0.2)
        with session_scope(harness.factory) as session:
            lost_ids = store.mark_lost_runs(session, stale_after=timedelta(seconds=3))
    assert lost_ids == [run_id]
    lost = harness.run(run_id)
    assert lost.status == "lost" and lost.checkpoint_step and lost.checkpoint_step >= 10
    recorded_before = harness.recorded_steps(run_id)
    assert recorded_before == list(range(1, len(recorded_before) + 1))

    harness.start_worker()
    with session_scope(harness.factory) as session:
        store.requeue_for_resume(session, run_id=run_id)
    enqueue_run(harness.celery, run_id=run_id)
    run = harness.wait("completed after resuming", lambda r: r.status == "completed", run_id)
    assert harness.recorded_steps(run_id) == list(range(1, 25))
    assert harness.rollouts_per_step(run_id) == {s: 8 for s in range(1, 25)}
    assert run.current_step == 24


@pytest.mark.parametrize("harness", ["embedded"], indirect=True)
def test_embedded_broker_needs_no_server(harness: Harness) -> None:
    assert harness.settings.broker_url == ""
    harness.start_worker()
    run_id = harness.launch(RunConfig(steps=3, seed=14))
    harness.wait("completed", lambda r: r.status == "completed", run_id, timeout=180)
    assert harness.recorded_steps(run_id) == [1, 2, 3]
    ping = harness.celery.control.inspect(timeout=10, limit=1).ping()  # its one worker's answer
    assert ping and any(name.startswith("rollout-lens-") for name in ping)


def test_broker_down_is_a_clear_error(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:1/0")
    # The enqueue gives up after its 1 s timeout; kombu's default retries would hang (`returns`).
    with pytest.raises(BrokerUnavailable, match="cannot be reached"):
        returns(lambda: enqueue_run(make_celery(settings), run_id=1, timeout=1), "the enqueue")


def test_steps_table_is_not_touched_by_a_skipped_delivery(
    session_factory: sessionmaker[Session],
) -> None:
    from tests.factories import make_run

    run_id = make_run(session_factory, steps=2)
    with session_scope(session_factory) as session:
        assert store.claim_run(session, run_id=run_id, task_id="a") is True
        assert store.claim_run(session, run_id=run_id, task_id="b") is False
        assert store.get_run(session, run_id=run_id).task_id == "a"
        assert session.scalar(select(func.count()).select_from(StepRow)) == 2
