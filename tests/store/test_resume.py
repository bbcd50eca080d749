"""A resumed trainer continues its run (server.store.resume), on both databases: the store's
truncation leaves a run equal to one that never had the later steps; over HTTP the real recorder
against the real app drops a step that comes before the run's last and goes on, a resume
supersedes the recorder it replaces, and concurrent overlapping bodies from two web processes
are written one at a time."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.errors import InvalidState
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.core.vocab import SPIKE_PROBES
from rollout_lens.server.exchange import wire
from rollout_lens.server.store import resume
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import AlertRow, RolloutRow, RollupRow, RunRow, StepRow
from rollout_lens.server.webapp.app import create_app
from rollout_lens.trainer.recorder.remote import RemoteStepWriter
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import (
    CONTROL_TOKENS,
    load_run,
    make_rollouts,
    remote_writer,
    script_writer,
)
from tests.web_support import serve_app

RECORDER = "record-token-0123456789abcdef"
FULL = "full-token-0123456789abcdef"


def _record(step: int) -> StepRecord:
    """A step with rollouts, the step columns and series; `late/x` is logged from step 24 on
    (a name the truncation must take back), and a control-token probe spikes after step 22
    (alerts)."""
    rng = random.Random(step)
    rollouts: list[RolloutRecord] = make_rollouts(rng, group_size=4)
    accuracy = rng.random()
    spike = 0.01 if step <= 22 else 0.9
    metrics: dict[str, float | None] = {"trl/custom": step * 0.5, SPIKE_PROBES[0]: spike}
    if step >= 24:
        metrics["late/x"] = float(step)
    return StepRecord(
        step=step,
        rollout_step=step,
        values={
            "reward_mean": accuracy,
            "true_accuracy": accuracy,
            "loss": rng.random(),
            "wall_time": 0.1,
        },
        rollouts=rollouts,
        metrics=metrics,
    )


def _new_run(factory: sessionmaker[Session], name: str) -> int:
    with session_scope(factory) as session:
        return store.create_run(
            session,
            name=name,
            model="m",
            total_steps=40,
            group_size=4,
            control_tokens=CONTROL_TOKENS,
            status="running",
            source="callback",
        ).id


def _write(factory: sessionmaker[Session], run_id: int, steps: range) -> None:
    writer = store.RunWriter(run_id, control_tokens=CONTROL_TOKENS)
    for step in steps:
        writer.commit(factory.kw["bind"], [_record(step)])


def _as_recorded(factory: sessionmaker[Session], run_id: int) -> dict[str, Any]:
    """What a run reads as, less what differs between two recordings of the same steps."""
    skip = {"id", "run_id", "recorded_at"}
    with session_scope(factory) as session:
        run = session.get(RunRow, run_id)
        assert run is not None
        columns = [c.key for c in StepRow.__table__.columns if c.key not in skip]
        return {
            "summary": (
                run.current_step,
                run.alerts_through,
                run.recent_true_accuracy,
                run.recent_reward,
                run.series_names,
            ),
            "steps": [
                tuple(getattr(s, c) for c in columns)
                for s in session.scalars(
                    select(StepRow).where(StepRow.run_id == run_id).order_by(StepRow.step)
                )
            ],
            "rollups": session.execute(
                select(RollupRow.width, RollupRow.bucket, RollupRow.data)
                .where(RollupRow.run_id == run_id)
                .order_by(RollupRow.width, RollupRow.bucket)
            ).all(),
            "alerts": session.execute(
                select(AlertRow.step, AlertRow.kind, AlertRow.series, AlertRow.message)
                .where(AlertRow.run_id == run_id)
                .order_by(AlertRow.step, AlertRow.kind, AlertRow.series)
            ).all(),
            "rollouts": session.execute(
                select(
                    RolloutRow.step,
                    RolloutRow.group,
                    RolloutRow.index,
                    RolloutRow.vote,
                    RolloutRow.verifier_reward,
                    RolloutRow.advantage,
                )
                .where(RolloutRow.run_id == run_id)
                .order_by(RolloutRow.step, RolloutRow.group, RolloutRow.index)
            ).all(),
        }


def test_a_resumed_run_reads_as_a_run_that_never_had_the_later_steps(
    session_factory: sessionmaker[Session],
) -> None:
    """Its rollups, summary columns, series names, alerts and rollouts after resume_run equal
    those of a run that only ever had the kept steps, and stay equal as both record on."""
    resumed, only = _new_run(session_factory, "resumed"), _new_run(session_factory, "only")
    _write(session_factory, resumed, range(1, 28))
    _write(session_factory, only, range(1, 21))
    before = _as_recorded(session_factory, resumed)
    assert before["alerts"] and before["summary"][4] == ["trl/custom", SPIKE_PROBES[0], "late/x"]
    with session_scope(session_factory) as session:
        store.mark_finished(session, run_id=resumed, status="lost", error="no heartbeat")
        assert store.resume_run(session, run_id=resumed, after_step=20) == 1
    was, kept = _as_recorded(session_factory, resumed), _as_recorded(session_factory, only)
    assert was["summary"][4] == ["trl/custom", SPIKE_PROBES[0]]
    assert was == kept
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=resumed)
        assert (run.status, run.error, run.finished_at, run.record_epoch) == (
            "running",
            None,
            None,
            1,
        )
    _write(session_factory, resumed, range(21, 34))
    _write(session_factory, only, range(21, 34))
    again = _as_recorded(session_factory, resumed)
    assert again["alerts"]  # the spike fired in both, at the same steps
    assert again == _as_recorded(session_factory, only)


def test_a_resume_before_the_first_step_and_of_ended_runs(
    session_factory: sessionmaker[Session],
) -> None:
    run_id = _new_run(session_factory, "early")
    _write(session_factory, run_id, range(1, 13))
    with session_scope(session_factory) as session:
        store.resume_run(session, run_id=run_id, after_step=0)
    empty = _as_recorded(session_factory, run_id)
    assert empty["summary"] == (0, 0, None, None, [])
    assert empty["steps"] == empty["rollups"] == empty["rollouts"] == []
    for status in ("completed", "cancelled"):
        with session_scope(session_factory) as session:
            store.mark_finished(session, run_id=run_id, status=status)
        with (
            pytest.raises(InvalidState, match=f"was {status}"),
            session_scope(session_factory) as s,
        ):
            store.resume_run(s, run_id=run_id, after_step=0)


# -- over HTTP ------------------------------------------------------------------------------------


@pytest.fixture
def dashboard(session_factory: sessionmaker[Session]) -> Iterator[str]:
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    app = create_app(
        Settings(database_url=url, auth_token=FULL, record_token=RECORDER),
        session_factory=session_factory,
    )
    with serve_app(app) as base:
        yield base


def _remote(base: str, **kwargs: Any) -> RemoteStepWriter:
    return remote_writer(base, RECORDER, "resumed", total_steps=40, **kwargs)


def test_a_step_before_the_last_is_dropped_and_the_recorder_goes_on(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    """put(30), put(3), put(31), put(32): step 3 is refused (a 409 naming it, never a 500),
    dropped and counted; the others are written and the run ends completed."""
    remote = _remote(dashboard)
    for step in (30, 3, 31, 32):
        remote.put(_record(step))
    assert remote.close(timeout=20)
    assert remote.dropped_steps == 1 and remote.run_id is not None
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    run, _, steps, _ = load_run(url, remote.run_id)
    assert run.status == "completed" and [s.step for s in steps] == [30, 31, 32]
    assert run.dropped_steps == 1
    refused = [n for n in run.notes if n.startswith(resume.REFUSED)]
    assert len(refused) == 1 and "step 3 comes after step 30" in refused[0], run.notes


def test_the_local_writer_drops_a_step_before_the_last_and_goes_on(
    session_factory: sessionmaker[Session],
) -> None:
    """The same order written locally: step 3 is refused by the store (StepOutOfOrder, not
    the rollups' ValueError that stopped the recording), dropped alone and counted."""
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    local = script_writer(url, "resumed", total_steps=40)
    for step in (30, 3, 31, 32):
        local.put(_record(step))
    assert local.close(timeout=20)
    assert local.dropped_steps == 1 and local.run_id is not None
    run, _, steps, _ = load_run(url, local.run_id)
    assert run.status == "completed" and [s.step for s in steps] == [30, 31, 32]


def _body(*steps: int) -> bytes:
    known = np.zeros(0, np.int64)
    return wire.body(wire.encode_step(_record(s), CONTROL_TOKENS, known).frame for s in steps)


def _create(http: httpx.Client, key: str, **extra: Any) -> httpx.Response:
    spec = {"key": key, "name": key, "control_tokens": list(CONTROL_TOKENS)} | extra
    return http.post("/api/record/runs", json=spec)


def test_a_resume_continues_the_run_and_supersedes_the_recorder_it_replaces(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    headers = {"authorization": f"Bearer {RECORDER}"}
    with httpx.Client(base_url=dashboard, headers=headers, timeout=30) as http:
        first = _create(http, "resume-key-0001")
        assert first.status_code == 201 and first.json()["epoch"] == 0
        run_id = first.json()["id"]
        steps = f"/api/record/runs/{run_id}/steps"
        assert http.post(steps, content=_body(1, 2, 3, 4, 5), params={"epoch": 0}).is_success
        again = _create(http, "resume-key-0001", resume_step=3)
        assert again.status_code == 200, again.text
        assert (again.json()["id"], again.json()["epoch"]) == (run_id, 1)
        # the replaced process: its steps, heartbeats and end are refused; it stops
        for path, kwargs in (
            (steps, {"content": _body(6)}),
            (f"/api/record/runs/{run_id}/heartbeat", {"json": {}}),
            (f"/api/record/runs/{run_id}/finish", {"json": {"status": "failed"}}),
        ):
            old = http.post(path, params={"epoch": 0}, **kwargs)
            assert old.status_code == 409 and old.json()["status"] == "superseded", old.text
        # the resumed one re-sends the steps after its checkpoint: each once
        resent = http.post(steps, content=_body(4, 5, 6), params={"epoch": 1})
        assert resent.status_code == 200 and resent.json()["written"] == [4, 5, 6]
        done = http.post(f"/api/record/runs/{run_id}/finish", json={}, params={"epoch": 1})
        assert done.status_code == 200
        ended = _create(http, "resume-key-0001", resume_step=2)
        assert ended.status_code == 409 and "records nothing more" in ended.json()["detail"]
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    run, rows, recorded, _ = load_run(url, run_id)
    assert run.status == "completed" and [s.step for s in recorded] == [1, 2, 3, 4, 5, 6]
    assert sorted({r["step"] for r in rows}) == [1, 2, 3, 4, 5, 6] and len(rows) == 6 * 4


def test_refusals_are_said_in_the_notes_within_a_bound(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    headers = {"authorization": f"Bearer {RECORDER}"}
    with httpx.Client(base_url=dashboard, headers=headers, timeout=30) as http:
        run_id = _create(http, "notes-key-0001").json()["id"]
        steps = f"/api/record/runs/{run_id}/steps"
        assert http.post(steps, content=_body(40)).status_code == 200
        for step in range(1, 13):
            early = http.post(steps, content=_body(step))
            assert early.status_code == 409 and early.json()["step"] == step
            assert f"step {step} comes after step 40" in early.json()["detail"]
    with session_scope(session_factory) as session:
        notes = store.get_run(session, run_id=run_id).notes
    refused = [n for n in notes if n.startswith(resume.REFUSED)]
    assert len(refused) == resume.REFUSAL_NOTES
    assert notes[-1] == f"{resume.MORE_REFUSED}{12 - resume.REFUSAL_NOTES}"


def test_concurrent_overlapping_bodies_from_two_web_processes(
    session_factory: sessionmaker[Session],
) -> None:
    """Two apps (two web processes: each its own kept writers and locks) on one database get
    overlapping bodies of one run at once, 20 times: each answered 200 or a 409 naming a step,
    never a 5xx, and the run holds each step once with its rollups as its steps say."""
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    settings = Settings(database_url=url, auth_token=FULL, record_token=RECORDER)
    apps = [create_app(settings, session_factory=session_factory) for _ in range(2)]
    headers = {"authorization": f"Bearer {RECORDER}"}
    with serve_app(apps[0]) as first, serve_app(apps[1]) as second:
        one = httpx.Client(base_url=first, headers=headers, timeout=60)
        two = httpx.Client(base_url=second, headers=headers, timeout=60)
        for round_ in range(20):
            run_id = _create(one, f"overlap-key-{round_:04d}").json()["id"]
            answers: list[httpx.Response] = []
            start = threading.Barrier(2)
            path = f"/api/record/runs/{run_id}/steps"
            threads = [
                threading.Thread(target=_send, args=(client, path, body, start, answers))
                for client, body in ((one, _body(1, 2, 3)), (two, _body(2, 3, 4)))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            codes = sorted(a.status_code for a in answers)
            assert codes in ([200, 200], [200, 409]), [a.text for a in answers]
            with session_scope(session_factory) as session:
                recorded = [s.step for s in store.steps(session, run_id=run_id)]
                rolled = rollouts_by_step(session, run_id)
            assert recorded in ([1, 2, 3, 4], [2, 3, 4]), recorded
            assert rolled == dict.fromkeys(recorded, 4)
        one.close()
        two.close()


def _send(
    client: httpx.Client,
    path: str,
    body: bytes,
    start: threading.Barrier,
    answers: list[httpx.Response],
) -> None:
    start.wait()
    answers.append(client.post(path, content=body))


def rollouts_by_step(session: Session, run_id: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    for step in session.scalars(select(RolloutRow.step).where(RolloutRow.run_id == run_id)):
        counts[step] = counts.get(step, 0) + 1
    return counts
