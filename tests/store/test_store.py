"""The store on a real SQLite file and the real PostgreSQL server."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.core.vocab import STEP_SERIES
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import (
    ROLLUP_WIDTHS,
    PromptRow,
    RolloutRow,
    RollupRow,
    RunRow,
    RunStatus,
    StepRow,
    utcnow,
)
from rollout_lens.server.store.serialize import rollout_dict
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tests.factories import CONTROL_TOKENS, make_rollouts, make_run, record_step


def test_run_round_trip_and_summary(session_factory) -> None:
    run_id = make_run(session_factory, steps=30)
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=run_id)
        assert run.status == RunStatus.queued
        assert run.current_step == 30
        recent = store.steps(session, run_id=run_id, since=5)
        assert [s.step for s in recent] == list(range(6, 31))
        expected = sum(s.true_accuracy for s in recent) / 25
        assert run.recent_true_accuracy == pytest.approx(expected)
        assert store.last_step(session, run_id=run_id) == 30


def test_prompts_are_stored_once(session_factory) -> None:
    make_run(session_factory, steps=5)  # each step's group shares one prompt
    make_run(session_factory, steps=5)  # same seed: the same five prompts again
    with session_scope(session_factory) as session:
        assert session.scalar(select(func.count()).select_from(PromptRow)) == 5
        assert session.scalar(select(func.count()).select_from(RolloutRow)) == 80


def test_step_rollouts_in_group_order_with_arrays(session_factory) -> None:
    run_id = make_run(session_factory, steps=3, seed=7)
    with session_scope(session_factory) as session:
        rows = store.step_rollouts(session, run_id=run_id, step=2)
        assert [r.index for r, _ in rows] == list(range(8))
        rollout, prompt = rows[3]
        data = rollout_dict(rollout, prompt, CONTROL_TOKENS)
    assert prompt.startswith("<user>Tools:")
    # Σ logprob is float64 from full precision; the per-token logprobs are float16 for display.
    assert data["sum_logprob"] == pytest.approx(sum(data["token_logprobs"]), rel=1e-3, abs=2e-3)
    assert set(data["control_token_probs"]) == set(CONTROL_TOKENS)
    assert all(len(v) == len(data["completion_ids"]) for v in data["control_token_probs"].values())
    assert all(0 <= p <= 1 for v in data["control_token_probs"].values() for p in v)


def test_reused_generation_points_at_its_rollouts(session_factory) -> None:
    run_id = make_run(session_factory, steps=1)
    record_step(session_factory, run_id, 2, rollout_step=1, values={"loss": 0.5})
    with session_scope(session_factory) as session:
        rows = store.step_rollouts(session, run_id=run_id, step=2)
        assert len(rows) == 8 and {r.step for r, _ in rows} == {1}
        # streamed a batch at a time (the API's rollouts.jsonl): the same rollouts, in order
        streamed = list(store.iter_rollouts(session, run_id=run_id, step=2, batch=3))
        assert [(r.id, p) for r, p in streamed] == [(r.id, p) for r, p in rows]


def test_one_step_is_one_transaction(session_factory) -> None:
    run_id = make_run(session_factory, steps=2)
    rollouts = make_rollouts(random.Random(3))
    duplicate = StepRecord(step=2, rollout_step=3, values={}, rollouts=rollouts, metrics={"x": 1.0})
    with pytest.raises(IntegrityError), session_scope(session_factory) as session:
        store.record_step(session, run_id=run_id, record=duplicate, control_tokens=CONTROL_TOKENS)
    with session_scope(session_factory) as session:
        assert session.scalar(select(func.count()).where(RolloutRow.step == 3)) == 0
        assert "x" not in store.series_names(session, run_id=run_id)
        assert session.scalar(select(func.count()).select_from(StepRow)) == 2


def test_nan_is_stored_as_null_and_series_read_back(session_factory) -> None:
    run_id = make_run(session_factory, steps=1)
    record_step(
        session_factory,
        run_id,
        2,
        values={"loss": float("nan")},
        metrics={"kl": float("inf"), "y": 2.0},
    )
    with session_scope(session_factory) as session:
        assert store.steps(session, run_id=run_id, since=1)[0].loss is None
        series = store.metric_series(session, run_id=run_id, names=["kl", "y"])
        assert series == {"kl": [(2, None)], "y": [(2, 2.0)]}


def test_status_transitions_and_cost(session_factory) -> None:
    run_id = make_run(session_factory, steps=1)
    with session_scope(session_factory) as session:
        store.mark_running(
            session, run_id=run_id, worker_host="h", device="cpu", control_tokens=["a"]
        )
        store.add_device_time(session, run_id=run_id, seconds=1800, price_per_hour=2.0)
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=run_id)
        assert (run.status, run.device, run.control_tokens) == ("running", "cpu", ["a"])
        assert run.cost == pytest.approx(1.0)
        store.mark_finished(session, run_id=run_id, status=RunStatus.failed, error="boom")
    with session_scope(session_factory) as session:
        run = store.get_run(session, run_id=run_id)
        assert (run.status, run.error) == ("failed", "boom") and run.finished_at is not None


def test_missing_run_is_not_found(session_factory) -> None:
    from rollout_lens.server.core.errors import NotFound

    with pytest.raises(NotFound, match="run 999"), session_scope(session_factory) as session:
        store.get_run(session, run_id=999)


def test_deleting_a_run_cascades(engine, session_factory) -> None:
    run_id = make_run(session_factory, steps=2)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM runs WHERE id = :id"), {"id": run_id})
    with session_scope(session_factory) as session:
        assert session.scalar(select(func.count()).select_from(RolloutRow)) == 0
        assert session.scalar(select(func.count()).select_from(StepRow)) == 0


def _rollups_from_raw(session: Session, run_id: int, width: int) -> dict[Any, Any]:
    """What the rollups must hold, computed in Python from the raw rows."""
    expected: dict = {}
    values = [
        (s.step, name, getattr(s, name))
        for s in store.steps(session, run_id=run_id)
        for name in STEP_SERIES
    ]
    values += [
        (step, name, v)
        for name, pts in store.metric_series(session, run_id=run_id).items()
        for step, v in pts
    ]
    for step, name, value in values:
        if value is None:
            continue
        n, total, lo, hi, first, last = expected.get(
            (name, (step - 1) // width), (0, 0.0, value, value, step, step)
        )
        expected[(name, (step - 1) // width)] = (
            n + 1,
            total + value,
            min(lo, value),
            max(hi, value),
            min(first, step),
            max(last, step),
        )
    return expected


def _rollups(session: Session, run_id: int, width: int) -> dict[Any, Any]:
    """The rollups as the store serves them (finished buckets from rows, the open one from its
    steps), in the shape of _rollups_from_raw."""
    names = [*STEP_SERIES, *store.series_names(session, run_id=run_id)]
    return {
        (name, (first - 1) // width): (n, mean * n, lo, hi, first, last)
        for name, buckets in store.rollup_series(
            session, run_id=run_id, names=names, width=width
        ).items()
        for first, last, n, mean, lo, hi in buckets
    }


def _rolled_rows(session: Session, run_id: int, width: int) -> list[int]:
    return list(
        session.scalars(
            select(RollupRow.bucket)
            .where(RollupRow.run_id == run_id, RollupRow.width == width)
            .order_by(RollupRow.bucket)
        )
    )


def _same(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    return a.keys() == b.keys() and all(
        x == pytest.approx(y) for k in a for x, y in zip(a[k], b[k], strict=True)
    )


def test_rollups_are_kept_current_and_rebuilt_after_truncation(session_factory) -> None:
    run_id = make_run(session_factory, steps=34)
    with session_scope(session_factory) as session:
        # Finished buckets are rows; the open one (31-34) is read from its steps.
        assert _rolled_rows(session, run_id, 10) == [0, 1, 2]
        assert _rolled_rows(session, run_id, 100) == []
        for width in ROLLUP_WIDTHS:
            assert _same(
                _rollups(session, run_id, width), _rollups_from_raw(session, run_id, width)
            )
        series = store.rollup_series(session, run_id=run_id, names=["true_accuracy"], width=10)[
            "true_accuracy"
        ]
        assert [(first, last, n) for first, last, n, *_ in series] == [
            (1, 10, 10),
            (11, 20, 10),
            (21, 30, 10),
            (31, 34, 4),
        ]
        assert [
            b[0]
            for b in store.rollup_series(
                session, run_id=run_id, names=["loss"], width=10, since=25
            )["loss"]
        ] == [21, 31]
        store.truncate_after(session, run_id=run_id, step=17)
    with session_scope(session_factory) as session:
        assert store.last_step(session, run_id=run_id) == 17
        assert _rolled_rows(session, run_id, 10) == [0]
    for step in range(18, 24):  # resumed: bucket 1 finishes again when step 21 lands
        record_step(session_factory, run_id, step, metrics={"x": float(step)})
    with session_scope(session_factory) as session:
        assert _rolled_rows(session, run_id, 10) == [0, 1]
        for width in ROLLUP_WIDTHS:
            assert _same(
                _rollups(session, run_id, width), _rollups_from_raw(session, run_id, width)
            )


def test_launched_runs_get_names_no_other_run_has(session_factory) -> None:
    """Two launches of one preset: "patched (top-4) seed 0", then "… seed 0 (2)", in the row and
    in its config; a name with LIKE's wildcards is matched as text."""
    columns = {"name": "patched (top-4) seed 0", "model": "tiny", "total_steps": 5}
    columns |= {"group_size": 8, "config": {"name": "patched (top-4) seed 0", "steps": 5}}
    with session_scope(session_factory) as session:
        runs = [store.create_launched_run(session, dict(columns)) for _ in range(3)]
        names = [r.name for r in runs]
        assert names == [
            "patched (top-4) seed 0",
            "patched (top-4) seed 0 (2)",
            "patched (top-4) seed 0 (3)",
        ]
        assert [r.config["name"] for r in runs] == names
        odd = store.create_launched_run(session, columns | {"name": "50%_off", "config": {}})
        assert odd.name == "50%_off" and store.unique_run_name(session, name="50%") == "50%"
        long = "x" * 200
        store.create_launched_run(session, columns | {"name": long, "config": {}})
        again = store.create_launched_run(session, columns | {"name": long, "config": {}})
        assert again.name == "x" * 196 + " (2)"


def test_a_run_whose_process_died_while_starting_is_lost_and_a_waiting_one_stays_queued(
    session_factory,
) -> None:
    """A queued run with a phase was taken by a process (the demo's, `train`'s): when its
    heartbeat stops, it is lost with the reason; a run still waiting in the queue is not."""
    stale = timedelta(seconds=60)
    with session_scope(session_factory) as session:
        ids = [
            store.create_run(session, name=n, model="tiny", total_steps=5, group_size=8).id
            for n in ("starting", "waiting", "starting, alive")
        ]
        starting, waiting, alive = ids
        store.set_phase(session, run_id=starting, phase="starting: loading torch and TRL")
        store.set_phase(session, run_id=alive, phase="starting: loading torch and TRL")
        for run_id in (starting, waiting):
            store.heartbeat(session, run_id=run_id, at=utcnow() - stale - timedelta(seconds=5))
    with session_scope(session_factory) as session:
        assert store.mark_lost_runs(session, stale_after=stale) == [starting]
    with session_scope(session_factory) as session:
        lost = store.get_run(session, run_id=starting)
        assert lost.status == RunStatus.lost and lost.phase is None
        assert (
            lost.error == "its process stopped while starting the run (no heartbeat for over 60 s)"
        )
        assert store.get_run(session, run_id=waiting).status == RunStatus.queued
        assert store.get_run(session, run_id=alive).status == RunStatus.queued


@pytest.mark.parametrize(
    ("stale_after", "said"),
    [
        (timedelta(seconds=90), "over 90 s"),
        (timedelta(days=2, seconds=5), "over 172,805 s"),
        (timedelta(seconds=1.5), "over 1.5 s"),
    ],
)
def test_a_lost_run_says_its_whole_threshold(
    session_factory, stale_after: timedelta, said: str
) -> None:
    run_id = make_run(session_factory, steps=1)
    with session_scope(session_factory) as session:
        store.mark_running(session, run_id=run_id, worker_host="h", device="cpu", control_tokens=[])
        run = session.get(RunRow, run_id)
        run.heartbeat_at = utcnow() - stale_after - timedelta(seconds=10)
    with session_scope(session_factory) as session:
        assert store.mark_lost_runs(session, stale_after=stale_after) == [run_id]
    with session_scope(session_factory) as session:
        error = store.get_run(session, run_id=run_id).error
    assert error == f"the worker stopped sending heartbeats for {said}"
