"""A batch of steps whose commit lands while its answer is lost: the connection reset between the
server's COMMIT and the recorder reading its answer (a database restarting under a training run,
as tests/e2e/test_faults.py's proxy stops it). The retry must take those steps as written, not
write them again: written again, the first of them is refused before any insert (its
generation's rollouts are recorded already, or it is behind the run's last step), which failed a
launched run (CI, 6 Dec 2026) and dropped a script's step that was in the database."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from rollout_lens.server import store
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.writing import RunWriter
from rollout_lens.trainer.recorder.writer import StepWriter
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, load_run, recorder_spec, seeded_step

STEPS = 5


def _lose_the_answer_of(monkeypatch: pytest.MonkeyPatch, step: int) -> list[int]:
    """The first commit of a batch holding `step` lands, then fails as a reset connection does
    (the recorder's memory thrown away, as write_batch leaves it); the steps of that batch."""
    real = RunWriter.commit
    lost: list[int] = []

    def commit(self: RunWriter, engine: Any, records: Any, **kw: Any) -> None:
        real(self, engine, records, **kw)
        if not lost and step in [r.step for r in records]:
            lost.extend(r.step for r in records)
            self.recorder = None
            raise OperationalError("COMMIT", {}, ConnectionResetError("the answer was lost"))

    monkeypatch.setattr(RunWriter, "commit", commit)
    return lost


@pytest.mark.parametrize("launched", [True, False], ids=["launched", "script"])
def test_a_batch_whose_answer_was_lost_is_taken_as_written(
    session_factory: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    launched: bool,
) -> None:
    caplog.set_level(logging.INFO, logger="rollout_lens")
    lost = _lose_the_answer_of(monkeypatch, step=2)
    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    if launched:
        with session_scope(session_factory) as session:
            run_id = store.create_run(
                session, name="lost", model="m", total_steps=STEPS, group_size=4
            ).id
        writer = StepWriter.for_launched(
            session_factory,
            run_id=run_id,
            control_tokens=list(CONTROL_TOKENS),
            price_per_device_hour=0.0,
            process=False,  # the answer is lost in this process (the sink's code is the same)
        )
    else:
        spec = recorder_spec("lost", total_steps=STEPS)
        writer = StepWriter.for_script(database_url=url, spec=spec, prepare=lambda raw: raw)
    for step in range(1, STEPS + 1):
        writer.put(seeded_step(step))
    assert writer.close() is True  # a launched run raises its writer's error here
    run, rows, steps, _ = load_run(url, writer.run_id)  # type: ignore[arg-type]
    assert lost and 2 in lost  # the answer of a batch with step 2 was lost ...
    assert [s.step for s in steps] == list(range(1, STEPS + 1))  # ... and nothing was lost
    assert len(rows) == 4 * STEPS and run.dropped_steps == run.dropped_rollouts == 0
    assert "were already written" in caplog.text
