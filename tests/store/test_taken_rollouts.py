"""A step whose `rollout_step` names an earlier step whose rollouts the run has already: refused
alone with a 409 that says so (never the 503 of a unique key that the recorder retried forever),
on both databases; the real remote recorder and the local SQL writer drop it, count it and go on.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.exchange import wire
from rollout_lens.server.store import resume
from rollout_lens.server.webapp.app import create_app
from rollout_lens.trainer.recorder.writer import StepWriter
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, load_run, make_rollouts, recorder_spec, remote_writer
from tests.web_support import serve_app

RECORDER = "record-token-0123456789abcdef"
FULL = "full-token-0123456789abcdef"


def _record(step: int, rollout_step: int | None = None) -> StepRecord:
    """A step with a group of 4 rollouts generated at `rollout_step` (its own step if None)."""
    rng = random.Random(step)
    return StepRecord(
        step=step,
        rollout_step=step if rollout_step is None else rollout_step,
        values={"reward_mean": rng.random(), "true_accuracy": rng.random(), "loss": 0.5},
        rollouts=make_rollouts(rng, group_size=4),
    )


def _body(*records: StepRecord) -> bytes:
    known = np.zeros(0, np.int64)
    return wire.body(wire.encode_step(r, CONTROL_TOKENS, known).frame for r in records)


def _url(factory: sessionmaker[Session]) -> str:
    return factory.kw["bind"].url.render_as_string(hide_password=False)


@pytest.fixture
def dashboard(session_factory: sessionmaker[Session]) -> Iterator[str]:
    settings = Settings(database_url=_url(session_factory), auth_token=FULL, record_token=RECORDER)
    with serve_app(create_app(settings, session_factory=session_factory)) as base:
        yield base


def test_a_step_whose_rollouts_were_recorded_is_a_409_over_http(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    """Alone, after another step in its body, and twice in one body: a 409 naming the step and
    its rollout_step, the run's notes say so, nothing of the body is written; the run goes on."""
    headers = {"authorization": f"Bearer {RECORDER}"}
    with httpx.Client(base_url=dashboard, headers=headers, timeout=30) as http:
        created = http.post(
            "/api/record/runs",
            json={"key": "taken-key-0001", "name": "taken", "control_tokens": CONTROL_TOKENS},
        )
        run_id = created.json()["id"]
        steps = f"/api/record/runs/{run_id}/steps"
        assert http.post(steps, content=_body(_record(1), _record(2), _record(3))).is_success
        for body in (
            _body(_record(5, rollout_step=3)),
            _body(_record(4), _record(5, rollout_step=2)),
            _body(_record(6), _record(7, rollout_step=6)),
        ):
            answer = http.post(steps, content=body)
            assert answer.status_code == 409, answer.text
            said = answer.json()
            assert "status" not in said  # not a run that ended: the recorder goes on
            assert "rollouts" in said["detail"] and "were recorded" in said["detail"]
            assert said["step"] in (5, 7)
        # the step alone, generated at a step without rollouts, and the next steps: written
        assert http.post(steps, content=_body(_record(4))).json()["written"] == [4]
        bare = dataclasses.replace(_record(5), rollouts=[])
        assert http.post(steps, content=_body(bare)).json()["written"] == [5]
        late = _record(6, rollout_step=5)  # step 5 had none: its rollouts go there
        assert http.post(steps, content=_body(late)).json()["written"] == [6]
    run, rows, recorded, _ = load_run(_url(session_factory), run_id)
    assert [s.step for s in recorded] == [1, 2, 3, 4, 5, 6]
    assert sorted({r["step"] for r in rows}) == [1, 2, 3, 4, 5] and len(rows) == 5 * 4
    refused = [n for n in run.notes if n.startswith(resume.REFUSED)]
    assert len(refused) == 3 and all("were recorded" in n for n in refused), run.notes


def test_the_remote_recorder_drops_the_step_and_goes_on(
    session_factory: sessionmaker[Session], dashboard: str
) -> None:
    remote = remote_writer(dashboard, RECORDER, "taken-remote", total_steps=10)
    for record in (_record(1), _record(2), _record(3, rollout_step=2), _record(4)):
        remote.put(record)
    assert remote.close(timeout=20)
    assert remote.dropped_steps == 1 and remote.run_id is not None
    run, rows, recorded, _ = load_run(_url(session_factory), remote.run_id)
    assert run.status == "completed" and [s.step for s in recorded] == [1, 2, 4]
    assert run.dropped_steps == 1 and sorted({r["step"] for r in rows}) == [1, 2, 4]


def test_the_local_writer_drops_the_step_and_goes_on(
    session_factory: sessionmaker[Session],
) -> None:
    """The SQL path: the step is refused by the store (not the unique key it once took for a
    step written before, counting it neither written nor dropped), dropped alone and counted."""
    url = _url(session_factory)
    local = StepWriter.for_script(
        database_url=url, spec=recorder_spec("taken-local", total_steps=10), prepare=lambda r: r
    )
    for record in (_record(1), _record(2), _record(3, rollout_step=2), _record(4)):
        local.put(record)
    assert local.close(timeout=20)
    assert local.dropped_steps == 1 and local.run_id is not None
    assert local.written_steps == 3
    run, rows, recorded, _ = load_run(url, local.run_id)
    assert run.status == "completed" and [s.step for s in recorded] == [1, 2, 4]
    assert run.dropped_steps == 1 and sorted({r["step"] for r in rows}) == [1, 2, 4]
