"""RemoteStepWriter.close(timeout) against the real app, when the dashboard does not take the
steps in time: those still waiting are dropped and counted on the run, and the run ends as close
says (one more call for its end) rather than stay `running`; a dashboard that cannot be reached
at all leaves the run to the sweeper, and close still returns."""

from __future__ import annotations

import random
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.webapp.app import create_app
from rollout_lens.trainer.recorder.remote import RemoteStepWriter
from sqlalchemy.orm import Session, sessionmaker

from bench.tcp_proxy import TcpProxy
from tests.factories import load_run, make_rollouts, remote_writer
from tests.web_support import serve_app

RECORDER = "record-token-0123456789abcdef"


def _record(step: int) -> StepRecord:
    rng = random.Random(step)
    return StepRecord(
        step=step,
        rollout_step=step,
        values={"reward_mean": rng.random(), "true_accuracy": rng.random(), "loss": 0.5},
        rollouts=make_rollouts(rng, group_size=4),
    )


def _url(factory: sessionmaker[Session]) -> str:
    return factory.kw["bind"].url.render_as_string(hide_password=False)


@pytest.fixture
def app(session_factory: sessionmaker[Session]) -> object:
    settings = Settings(database_url=_url(session_factory), record_token=RECORDER)
    return create_app(settings, session_factory=session_factory)


@pytest.fixture
def dashboard(app: object) -> Iterator[str]:
    with serve_app(app) as base:
        yield base


def _remote(base: str) -> RemoteStepWriter:
    return remote_writer(base, RECORDER, "closing", total_steps=10)


def test_steps_a_busy_dashboard_never_took_are_counted_and_the_run_ends(
    session_factory: sessionmaker[Session], app: object, dashboard: str
) -> None:
    """Steps 1-2 written; then every slot of the dashboard's writing is taken (other trainers'
    bodies: each body of steps is a 503 Busy) while 3-5 wait: close(timeout=2) drops them,
    counts them, and the run ends completed with the count on it."""
    remote = _remote(dashboard)
    remote.put(_record(1))
    remote.put(_record(2))
    remote.flush()
    assert remote.written_steps == 2 and remote.run_id is not None
    slots = app.state.ingest.writing  # type: ignore[attr-defined]
    taken = [slots.acquire(blocking=False) for _ in range(8)]
    try:
        for step in (3, 4, 5):
            remote.put(_record(step))
        assert remote.close(timeout=2) is False
    finally:
        for got in taken:
            if got:
                slots.release()
    assert remote.busy_answers > 0 and remote.dropped_steps == 3
    run, _, steps, _ = load_run(_url(session_factory), remote.run_id)
    assert (run.status, run.dropped_steps) == ("completed", 3)
    assert [s.step for s in steps] == [1, 2]


def test_a_dashboard_gone_at_the_end_leaves_the_run_to_the_sweeper(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    """Cut between the recorder and the dashboard (bench/tcp_proxy.py) after step 1: close
    returns, the waiting steps are counted on the recorder, and the run is not marked ended by
    anything but its heartbeats stopping (the sweeper's `lost`)."""
    parts = urlsplit(dashboard)
    proxy = TcpProxy((parts.hostname or "127.0.0.1", parts.port or 80))
    proxy.start()
    try:
        remote = _remote(f"http://{proxy.host}:{proxy.port}")
        remote.put(_record(1))
        remote.flush()
        proxy.stop()
        for step in (2, 3):
            remote.put(_record(step))
        assert remote.close(timeout=1) is False
        assert remote.dropped_steps == 2 and remote.run_id is not None
    finally:
        proxy.close()
    run, _, steps, _ = load_run(_url(session_factory), remote.run_id)
    assert run.status == "running" and [s.step for s in steps] == [1]
