"""The write path of issue 27: a step committed before its search indexing (a crash between the
two mended by the next writer), and numpy arrays written as the lists they hold."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store import search
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RolloutDataRow
from sqlalchemy import Engine, select
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, make_rollouts


def _run(factory: sessionmaker[Session]) -> int:
    with session_scope(factory) as session:
        return store.create_run(
            session,
            name="w",
            model="tiny",
            total_steps=4,
            group_size=8,
            control_tokens=CONTROL_TOKENS,
        ).id


def _step(step: int, word: str, seed: int = 0) -> StepRecord:
    rollouts = make_rollouts(random.Random(seed), completion=f"<tool>x</tool> {word}")
    return StepRecord(step=step, rollout_step=step, values={}, rollouts=rollouts)


def _found(client: TestClient, run_id: int, word: str) -> int:
    answer = client.get(f"/api/runs/{run_id}/rollouts", params={"q": word})
    assert answer.status_code == 200, answer.text
    return int(answer.json()["total"])


def test_a_step_committed_but_not_indexed_is_indexed_by_the_next_writer(
    engine: Engine, session_factory: sessionmaker[Session], client: TestClient
) -> None:
    run_id = _run(session_factory)
    recorder = store.write_batch(
        engine,
        None,
        [_step(1, "alphaword")],
        run_id=run_id,
        control_tokens=CONTROL_TOKENS,
        price_per_hour=0.0,
    )
    assert _found(client, run_id, "alphaword") == 8 and not recorder.unindexed
    # the writer stops between the commit of step 2 and its indexing (a crash)
    with engine.begin() as conn:
        recorder.write(conn, _step(2, "betaword"), index=False)
    assert len(recorder.unindexed) == 8
    assert _found(client, run_id, "betaword") == 0
    with engine.connect() as conn:
        waiting = search.unindexed(conn, run_id=run_id, token_texts={})
    assert [text for _, text in waiting] == ["<tool>x</tool> betaword"] * 8
    # a new writer of the run (the process restarted) mends it with its first batch
    store.write_batch(
        engine,
        None,
        [_step(3, "gammaword")],
        run_id=run_id,
        control_tokens=CONTROL_TOKENS,
        price_per_hour=0.0,
    )
    assert [_found(client, run_id, w) for w in ("alphaword", "betaword", "gammaword")] == [8] * 3
    with engine.connect() as conn:
        assert search.unindexed(conn, run_id=run_id, token_texts={}) == []


def test_arrays_are_written_as_the_lists_they_hold(
    engine: Engine, session_factory: sessionmaker[Session]
) -> None:
    """The same step given as lists (rows by token) and as arrays (control [position × token])
    stores the same bytes, and Σ logprob is the same float."""
    as_lists, as_arrays = _step(1, "w", seed=5), _step(2, "w", seed=5)
    for r in as_arrays.rollouts:
        r.completion_ids = np.asarray(r.completion_ids, dtype=np.int64)
        r.token_logprobs = np.asarray(r.token_logprobs)
        r.control_probs = {t: np.asarray(v) for t, v in r.control_probs.items()}
    as_arrays.rollouts[0].token_logprobs[1] = as_lists.rollouts[0].token_logprobs[1] = -math.inf
    as_arrays.rollouts[1].token_logprobs[2] = as_lists.rollouts[1].token_logprobs[2] = math.nan
    assert [r.sum_logprob for r in as_lists.rollouts[2:]] == [
        r.sum_logprob for r in as_arrays.rollouts[2:]
    ]
    run_id = _run(session_factory)
    store.write_batch(
        engine,
        None,
        [as_lists, as_arrays],
        run_id=run_id,
        control_tokens=CONTROL_TOKENS,
        price_per_hour=0.0,
    )
    with session_scope(session_factory) as session:
        rows = session.execute(
            select(RolloutDataRow.ids, RolloutDataRow.logprobs, RolloutDataRow.control).order_by(
                RolloutDataRow.rollout_id
            )
        ).all()
    assert len(rows) == 16 and rows[:8] == rows[8:]


@pytest.mark.parametrize(
    "engine", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_postgres_refuses_a_value_too_long_as_a_one_row_insert_would(
    engine: Engine, session_factory: sessionmaker[Session]
) -> None:
    """The bulk insert sends text as TEXT arrays: the column, not a cast, decides (a cast to
    VARCHAR(32) would cut a long format state silently)."""
    step = _step(1, "w")
    step.rollouts[0].format_state = "x" * 40
    run_id = _run(session_factory)
    with pytest.raises(DataError):
        store.write_batch(
            engine, None, [step], run_id=run_id, control_tokens=CONTROL_TOKENS, price_per_hour=0.0
        )
