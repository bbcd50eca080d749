"""Faults against the real services, each bounded in count and time.

- PostgreSQL goes away under a real Celery worker training the tiny model (a loopback proxy is
  cut: the machine's PostgreSQL is shared and is not restarted): the run pauses, resumes, and
  completes with every step exactly once; a database that stays away fails the writer clearly.
- Redis (our own redis-server, append-only as docker-compose runs it) is stopped with a run
  queued: launching answers 503 and creates nothing; restarted, the queued run starts, and when
  two workers are handed it, one trains it and the other skips it.
- The disk is full (RLIMIT_FSIZE on the recording process, as root cannot be stopped by chmod):
  the run fails with the database's message, in the log too; the web app serves what it has.
- Two workers claim the same runs at once (SQLite and PostgreSQL): each run is taken once.
The worker killed mid-step is tests/e2e/test_worker.py's test_killed_worker_is_lost_then_resumed...
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.queue import enqueue_run, make_celery
from rollout_lens.server.core.runconfig import RunConfig
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunRow, RunStatus
from rollout_lens.server.webapp.app import create_app
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from bench import faults
from bench.tcp_proxy import database_proxy
from tests import factories
from tests.waiting import returns

ROOT = Path(__file__).resolve().parents[2]
TRAIN_TIMEOUT = 240  # seconds: worker start, model load and a short run, on a busy machine


class Worker:
    """A `rollout-lens worker` subprocess with the given settings, logging to a file."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LENS_")}
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollout_lens", "worker", "--loglevel", "INFO"],
                env=base | {"PYTHONPATH": str(ROOT)} | env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def worker_env(data_dir: Path, tiny_model_dir: Path, **settings: str) -> dict[str, str]:
    return {
        "ROLLOUT_LENS_DATA_DIR": str(data_dir),
        "ROLLOUT_LENS_MODEL_CACHE_DIR": str(tiny_model_dir.parent),
        "ROLLOUT_LENS_HEARTBEAT_SECONDS": "0.5",
        "ROLLOUT_LENS_CHECKPOINT_EVERY": "5",
    } | {f"ROLLOUT_LENS_{k.upper()}": v for k, v in settings.items()}


def wait_for(
    factory: sessionmaker[Session],
    run_id: int,
    what: str,
    done: Callable[[RunRow], bool],
    workers: list[Worker],
    timeout: float = TRAIN_TIMEOUT,
) -> RunRow:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with session_scope(factory) as session:
            run = store.get_run(session, run_id=run_id)
        if done(run):
            return run
        if all(w.proc.poll() is not None for w in workers):
            break
        time.sleep(0.2)
    logs = "\n".join(w.text()[-3000:] for w in workers)
    pytest.fail(f"run {run_id} never {what}: it is {run.status} at step {run.current_step}\n{logs}")


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_a_worker_rides_out_postgresql_going_away(tmp_path: Path, tiny_model_dir: Path) -> None:
    with faults.pg_database() as url, faults.RedisServer(tmp_path / "redis") as broker:
        proxy, through_proxy = database_proxy(url)
        proxy.start()
        engine = make_engine(url)  # the test reads directly, never through the proxy
        factory = make_session_factory(engine)
        worker = Worker(
            worker_env(
                tmp_path / "data", tiny_model_dir, database_url=through_proxy, broker_url=broker.url
            ),
            tmp_path / "worker.log",
        )
        try:
            config = RunConfig(steps=24, seed=21)
            with session_scope(factory) as session:
                run_id = store.create_run(session, **config.run_columns()).id
            enqueue_run(make_celery(Settings(broker_url=broker.url)), run_id=run_id)
            wait_for(factory, run_id, "reached step 6", lambda r: r.current_step >= 6, [worker])
            proxy.stop()  # every connection reset, new ones refused: a restarting server
            cut_at = factories.recorded_steps(factory, run_id)[-1]
            time.sleep(4)
            assert factories.recorded_steps(factory, run_id)[-1] <= cut_at + 1  # it paused
            proxy.start()
            run = wait_for(factory, run_id, "completed", lambda r: r.status != "running", [worker])
            log = worker.text()
            steps = factories.recorded_steps(factory, run_id)
            rollouts = factories.rollouts_per_step(factory, run_id)
        finally:
            worker.stop()
            proxy.close()
            engine.dispose()
        assert run.status == RunStatus.completed and run.error is None, run.error
        assert steps == list(range(1, 25))  # none lost, none twice
        assert rollouts == {s: 8 for s in range(1, 25)}
        assert run.checkpoint_step == 24
        assert "the database failed while" in log and "the database is back after" in log


@pytest.mark.postgres
def test_a_database_that_stays_away_fails_the_writer_clearly(
    pg_database_url: str, pg_engine: Engine
) -> None:
    from rollout_lens.trainer.recorder.writer import StepWriter

    proxy, through_proxy = database_proxy(pg_database_url)
    proxy.start()
    engine = make_engine(through_proxy)
    factory = make_session_factory(engine)
    run_id = factories.make_run(factory, steps=2)
    writer = StepWriter.for_launched(
        factory,
        run_id=run_id,
        control_tokens=factories.CONTROL_TOKENS,
        price_per_device_hour=0,
        give_up_after=1.5,
    )
    proxy.stop()
    from rollout_lens.server.core.records import StepRecord

    writer.put(StepRecord(step=3, rollout_step=3, values={}))
    # The writer gives up after 1.5 s; one that retried for ever would hang (`returns`).
    with pytest.raises(
        RuntimeError, match=r"recording step 3 of run \d+ failed: the database could"
    ):
        returns(writer.close, "the writer's close")
    proxy.close()
    engine.dispose()
    steps = factories.recorded_steps(make_session_factory(pg_engine), run_id)
    assert steps == [1, 2]  # what was written before stays


@pytest.mark.slow
@pytest.mark.redis
def test_broker_down_then_two_workers_given_the_same_run(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data_dir = tmp_path / "data"
    with faults.RedisServer(tmp_path / "redis") as broker:
        settings = Settings(
            data_dir=data_dir, broker_url=broker.url, model_cache_dir=tiny_model_dir.parent
        )
        engine = make_engine(settings.database_url)
        upgrade(engine)
        factory = make_session_factory(engine)
        client = TestClient(create_app(settings), base_url="http://127.0.0.1")

        def launch(seed: int) -> object:
            client.cookies.clear()  # as a script: no cookies, no CSRF token needed
            return client.post("/api/runs", json={"steps": 3, "seed": seed})

        queued = launch(31)
        assert queued.status_code == 201, queued.text  # type: ignore[attr-defined]
        run_id = queued.json()["runs"][0]["id"]  # type: ignore[attr-defined]
        broker.stop()
        env = worker_env(data_dir, tiny_model_dir, broker_url=broker.url)
        workers = [Worker(env, tmp_path / "worker0.log")]  # started while Redis is down
        try:
            refused = launch(32)
            assert refused.status_code == 503  # type: ignore[attr-defined]
            assert "cannot be reached" in refused.json()["detail"]  # type: ignore[attr-defined]
            assert client.get("/").status_code == 200  # the dashboard keeps serving
            with session_scope(factory) as session:
                assert [r.id for r in store.list_runs(session)] == [run_id]  # nothing created
                assert store.get_run(session, run_id=run_id).status == RunStatus.queued
            deadline = time.monotonic() + 60
            while "Cannot connect to redis" not in workers[0].text():
                assert time.monotonic() < deadline, workers[0].text()[-3000:]
                time.sleep(0.2)
            broker.start()  # the append-only file still holds the queued run's message
            enqueue_run(make_celery(settings), run_id=run_id)  # and a second delivery of it
            workers.append(Worker(env, tmp_path / "worker1.log"))
            run = wait_for(factory, run_id, "completed", lambda r: r.status == "completed", workers)
            deadline = time.monotonic() + 60
            logs = ""
            while "skipping this delivery" not in logs and time.monotonic() < deadline:
                time.sleep(0.5)
                logs = "".join(w.text() for w in workers)
            steps = factories.recorded_steps(factory, run_id)
            rollouts = factories.rollouts_per_step(factory, run_id)
        finally:
            for w in workers:
                w.stop()
            engine.dispose()
    assert steps == [1, 2, 3] and rollouts == {1: 8, 2: 8, 3: 8}
    # One worker trained it; the other found it taken (claim_run) and skipped its delivery.
    assert logs.count("skipping this delivery") == 1 and logs.count(f"'run {run_id} finished'") == 1
    assert run.task_id and run.worker_host


def test_a_full_disk_fails_the_run_clearly_and_the_dashboard_serves(tmp_path: Path) -> None:
    result = faults.disk_full(tmp_path / "full")
    assert result.survived, result
    assert result.recorded >= 1 and result.lost == 0 and result.duplicated == 0


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_two_workers_claiming_the_same_runs_take_each_once(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    if backend == "postgres":
        url = request.getfixturevalue("pg_database_url")
        request.getfixturevalue("pg_engine")  # migrated
    else:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
    result = faults.two_claims(url, runs=30)
    assert result.survived and result.recorded == 30, result
