"""Stop means stop (issue 48): a cancel from the dashboard ends a run a user's script records,
and its recorder hears it on its next request (a 409 with the run's status) and stops; a run
whose recorder is still sending can be deleted; a finished run is never reopened by its token
(only the sweeper's `lost` is undone by a heartbeat). A real uvicorn dashboard on the test's
database; the trainer's own writers (RemoteStepWriter over HTTP, StepWriter locally)."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import numpy as np
import pytest
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.exchange import wire
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow, RunStatus
from rollout_lens.server.webapp.app import create_app
from rollout_lens.server.webapp.http.security import token_name
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import (
    CONTROL_TOKENS,
    load_run,
    make_rollouts,
    remote_writer,
    script_writer,
)
from tests.waiting import until
from tests.web_support import loopback, parse, serve_app

FULL = "full-token-0123456789abcdef"
RECORDER = "record-token-0123456789abcdef"
BY_FULL = f"dashboard ({token_name(FULL)})"


@pytest.fixture
def dashboard(session_factory: sessionmaker[Session]) -> Iterator[str]:
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    app = create_app(
        Settings(database_url=url, auth_token=FULL, record_token=RECORDER),
        session_factory=session_factory,
    )
    with serve_app(app) as base:
        yield base


def _url(factory: sessionmaker[Session]) -> str:
    return factory.kw["bind"].url.render_as_string(hide_password=False)


def _step(step: int) -> StepRecord:
    return StepRecord(
        step=step,
        rollout_step=step,
        values={"reward_mean": 0.5, "wall_time": 0.1},
        rollouts=make_rollouts(random.Random(step), group_size=4, listed=4),
        metrics={},
    )


def _body(*steps: int) -> bytes:
    known = np.zeros(0, np.int64)
    return wire.body(wire.encode_step(_step(s), CONTROL_TOKENS, known).frame for s in steps)


def _post(base: str, path: str, token: str, **kwargs: Any) -> httpx.Response:
    headers = kwargs.pop("headers", {}) | {"authorization": f"Bearer {token}"}
    return loopback("POST", base + path, headers=headers, timeout=30, **kwargs)


def _new_run(base: str, key: str) -> int:
    spec = {"key": key, "name": key, "control_tokens": list(CONTROL_TOKENS)}
    answer = _post(base, "/api/record/runs", RECORDER, json=spec)
    assert answer.status_code == 201, answer.text
    return int(answer.json()["id"])


def _ended(answer: httpx.Response, status: str, ended_by: str | None) -> None:
    assert answer.status_code == 409, answer.text
    body = answer.json()
    assert (body["status"], body["ended_by"]) == (status, ended_by), body
    assert body["detail"]


def test_a_cancel_ends_a_recorded_run_and_every_later_request_hears_it(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    run_id = _new_run(dashboard, "cancel-key-0001")
    steps, beat = f"/api/record/runs/{run_id}/steps", f"/api/record/runs/{run_id}/heartbeat"
    finish = f"/api/record/runs/{run_id}/finish"
    assert _post(dashboard, steps, RECORDER, content=_body(1)).status_code == 200
    cancelled = _post(dashboard, f"/api/runs/{run_id}/cancel", FULL)
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled"  # at once: no worker of ours trains it
    _ended(_post(dashboard, steps, RECORDER, content=_body(2)), "cancelled", BY_FULL)
    _ended(_post(dashboard, steps, RECORDER, content=b"x", params={"steps": "2"}), "cancelled",
           BY_FULL)  # fmt: skip
    _ended(_post(dashboard, beat, RECORDER, json={}), "cancelled", BY_FULL)
    _ended(_post(dashboard, finish, RECORDER, json={"status": "completed"}), "cancelled", BY_FULL)
    # the callback finishing as it was told: done, nothing changes
    told = _post(dashboard, finish, RECORDER, json={"status": "cancelled"})
    assert told.status_code == 200, told.text
    run, _, recorded, _ = load_run(_url(session_factory), run_id)
    assert [s.step for s in recorded] == [1]
    assert (run.status, run.ended_by) == ("cancelled", BY_FULL) and run.finished_at is not None
    # the run's JSON twin and page say who stopped it and when
    twin = loopback("GET", f"{dashboard}/api/runs/{run_id}", timeout=10).json()
    assert twin["run"]["ended_by"] == BY_FULL and twin["live"]["text"]["ended_by"] == BY_FULL
    page = parse(loopback("GET", f"{dashboard}/runs/{run_id}", timeout=10).text)
    assert page.find("dd", data_field="ended_by").text == BY_FULL
    assert page.find("dd", data_field="finished_at").text.endswith("UTC")


def test_a_token_cannot_reopen_the_run_it_finished_only_the_sweepers_lost_revives(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    run_id = _new_run(dashboard, "reopen-key-0001")
    steps, beat = f"/api/record/runs/{run_id}/steps", f"/api/record/runs/{run_id}/heartbeat"
    finish = f"/api/record/runs/{run_id}/finish"
    assert _post(dashboard, steps, RECORDER, content=_body(1)).status_code == 200
    assert _post(dashboard, finish, RECORDER, json={"status": "lost"}).status_code == 200
    _ended(_post(dashboard, beat, RECORDER, json={}), "lost", "recorder")
    _ended(_post(dashboard, steps, RECORDER, content=_body(2)), "lost", "recorder")
    _ended(_post(dashboard, finish, RECORDER, json={"status": "completed"}), "lost", "recorder")
    run, _, recorded, _ = load_run(_url(session_factory), run_id)
    assert run.status == "lost" and [s.step for s in recorded] == [1]

    # the sweeper's `lost` (its heartbeats stopped: a network cut) is not an end
    cut = _new_run(dashboard, "reopen-key-0002")
    with session_scope(session_factory) as session:
        session.execute(
            update(RunRow).where(RunRow.id == cut).values(heartbeat_at=RunRow.created_at)
        )
    with session_scope(session_factory) as session:
        assert cut in store.mark_lost_runs(session, stale_after=timedelta(0))
        assert store.get_run(session, run_id=cut).ended_by == "sweeper"
    alive = _post(dashboard, f"/api/record/runs/{cut}/heartbeat", RECORDER, json={})
    assert alive.status_code == 200, alive.text
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=cut)
        assert (run.status, run.ended_by, run.error, run.finished_at) == (
            "running",
            None,
            None,
            None,
        )
    done = _post(dashboard, f"/api/record/runs/{cut}/finish", RECORDER, json={})
    assert done.status_code == 200
    with session_scope(session_factory) as session:
        assert store.get_run(session, run_id=cut).ended_by == "recorder"


def test_the_recorder_stops_at_a_cancel_and_drops_what_waits(
    session_factory: sessionmaker[Session], dashboard: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer = remote_writer(dashboard, RECORDER, "stopped", total_steps=20)
    writer.put(_step(1))
    until(lambda: writer.written_steps == 1, "step 1")
    assert not writer.stop_requested
    assert writer.run_id is not None
    assert _post(dashboard, f"/api/runs/{writer.run_id}/cancel", FULL).status_code == 200
    with caplog.at_level(logging.WARNING, logger="rollout_lens"):
        # heard on the next request: a heartbeat between slow steps, or the next steps
        until(lambda: writer.stop_requested, "the cancel")
        for step in (2, 3):
            writer.put(_step(step))  # the training thread's next steps: nothing more is sent
        assert writer.close(status=RunStatus.cancelled)
    said = [r.getMessage() for r in caplog.records if "cancelled run" in r.getMessage()]
    assert said == [
        f"Rollout Lens: the dashboard cancelled run {writer.run_id} (by {token_name(FULL)}): "
        "training stops"
    ]
    assert "could not be written" not in caplog.text  # dropped on purpose, not lost
    assert writer.written_steps == 1 and writer.dropped_steps == 0
    run, _, recorded, _ = load_run(_url(session_factory), writer.run_id)
    assert [s.step for s in recorded] == [1]
    assert (run.status, run.ended_by) == ("cancelled", BY_FULL)


def test_a_local_recording_stops_at_a_cancel_from_the_dashboard(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    """A script recording straight into the database: its writer reads the run's status before
    it writes, so the dashboard's cancel stops it the same way."""
    writer = script_writer(_url(session_factory), "stopped", total_steps=20, heartbeat_seconds=0.2)
    writer.put(_step(1))
    until(lambda: writer.written_steps == 1, "step 1")
    assert writer.run_id is not None
    live = _post(dashboard, f"/api/runs/{writer.run_id}/cancel", FULL).json()
    assert live["status"] == "cancelled" and not live["can_cancel"]
    until(lambda: writer.stop_requested, "the cancel")
    writer.put(_step(2))
    assert writer.close(status=RunStatus.cancelled)
    run, _, recorded, _ = load_run(_url(session_factory), writer.run_id)
    assert [s.step for s in recorded] == [1]
    assert (run.status, run.ended_by) == ("cancelled", BY_FULL)


def test_an_admin_deletes_a_run_whose_recorder_still_sends(
    session_factory: sessionmaker[Session], dashboard: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer = remote_writer(dashboard, RECORDER, "stopped", total_steps=20, heartbeat_seconds=60)
    writer.put(_step(1))
    until(lambda: writer.written_steps == 1, "step 1")
    run_id = writer.run_id
    assert run_id is not None
    deleted = loopback(
        "DELETE",
        f"{dashboard}/api/runs/{run_id}",
        headers={"authorization": f"Bearer {FULL}"},
        timeout=30,
    )
    assert deleted.status_code == 200, deleted.text
    # SQLite gives the newest run's id to the next run made: the old recorder is not its
    newer = _new_run(dashboard, "after-delete-key-0001")
    with caplog.at_level(logging.WARNING, logger="rollout_lens"):
        writer.put(_step(2))
        until(lambda: writer.dropped_steps == 1, "the refusal")
        assert not writer.stop_requested  # the script trains on
        assert writer.close()
    assert "recording stopped, training goes on" in caplog.text and "404" in caplog.text
    with session_scope(session_factory) as session:
        assert store.get_run(session, run_id=newer).current_step == 0  # nothing of the old one
        assert session.get(RunRow, run_id) is None or run_id == newer
    # a run launched here and training is still refused: its worker stops it first
    with session_scope(session_factory) as session:
        launched = store.create_run(
            session, name="launched", model="m", total_steps=5, group_size=2
        )
        store.mark_running(
            session, run_id=launched.id, worker_host="h", device="cpu", control_tokens=[]
        )
        launched_id = launched.id
    refused = loopback(
        "DELETE",
        f"{dashboard}/api/runs/{launched_id}",
        headers={"authorization": f"Bearer {FULL}"},
        timeout=30,
    )
    assert refused.status_code == 409 and "cancel it first" in refused.json()["detail"]


def test_a_launched_run_keeps_who_asked_it_to_stop(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    with session_scope(session_factory) as session:
        run = store.create_run(session, name="launched", model="m", total_steps=5, group_size=2)
        store.mark_running(session, run_id=run.id, worker_host="h", device="cpu", control_tokens=[])
        run_id = run.id
    live = _post(dashboard, f"/api/runs/{run_id}/cancel", FULL).json()
    assert live["status"] == "running" and live["cancel_requested"]  # its worker stops it
    assert live["text"]["ended_by"] == "—"  # not ended yet
    with session_scope(session_factory) as session:
        store.mark_finished(session, run_id=run_id, status=RunStatus.cancelled, ended_by="worker")
    with session_scope(session_factory) as session:
        assert store.get_run(session, run_id=run_id).ended_by == BY_FULL


def test_steps_racing_a_cancel_land_before_it_or_not_at_all(
    session_factory: sessionmaker[Session],
) -> None:
    """The cancel holds the run's row (uncommitted) while a recorder's write starts: the write
    waits for it, then is refused whole (RunEnded), never written after the cancel."""
    import threading

    from rollout_lens.server.core.errors import RunEnded
    from rollout_lens.server.store import ending

    engine = session_factory.kw["bind"]
    with session_scope(session_factory) as session:
        run = store.create_run(
            session, name="race", model="m", total_steps=5, group_size=4, source="callback"
        )
        store.mark_running(session, run_id=run.id, worker_host="h", device="cpu", control_tokens=[])
        run_id = run.id
    writer = store.RunWriter(run_id, control_tokens=list(CONTROL_TOKENS))
    writer.commit(engine, [_step(1)], guard=lambda conn: ending.recorder_alive(conn, run_id=run_id))
    outcome: list[BaseException | None] = []

    def write() -> None:
        try:
            writer.commit(
                engine, [_step(2)], guard=lambda conn: ending.recorder_alive(conn, run_id=run_id)
            )
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            outcome.append(exc)

    cancel = session_factory()
    try:
        assert store.request_cancel(cancel, run_id=run_id, ended_by=BY_FULL) == "cancelled"
        racing = threading.Thread(target=write)
        racing.start()
        racing.join(timeout=0.5)  # it waits on the cancel's hold of the run (it cannot finish)
        cancel.commit()
    finally:
        cancel.close()
    racing.join(timeout=60)
    assert len(outcome) == 1 and isinstance(outcome[0], RunEnded), outcome
    assert (outcome[0].status, outcome[0].ended_by) == ("cancelled", BY_FULL)
    _, _, recorded, _ = load_run(_url(session_factory), run_id)
    assert [s.step for s in recorded] == [1]
