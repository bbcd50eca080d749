"""A rollout's mismatch scalars (rollouts.abs_diff_max, rollouts.log_seq_ratio; issue 47) on
both databases: equal to mismatch.rollout_figures over its stored arrays read back, the same
through every write path (the store's, the HTTP wire's, an export's import), backfilled by
migration 0021 as the writer writes them, and the explorer's filters and sorts on them against
a brute-force answer over the same rows (NULLs where a rollout has no generator side)."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.exchange import export, importer, wire
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.migrate import downgrade, upgrade
from rollout_lens.server.store.models import RolloutRow
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, make_run
from tests.mismatch_support import mismatch_run, mismatch_steps, stored_figures
from tests.web_support import client_for, explorer_pages
from tests.wire_support import record_run


def _columns(factory: sessionmaker[Session], run_id: int) -> dict[tuple[int, int, int], Any]:
    """(step, group, index) → (abs_diff_max, log_seq_ratio) as stored."""
    with session_scope(factory) as session:
        rows = session.execute(
            select(
                RolloutRow.step,
                RolloutRow.group,
                RolloutRow.index,
                RolloutRow.abs_diff_max,
                RolloutRow.log_seq_ratio,
            ).where(RolloutRow.run_id == run_id)
        ).all()
    return {(s, g, i): (d, r) for s, g, i, d, r in rows}


def test_the_columns_are_the_figures_of_the_stored_arrays(
    session_factory: sessionmaker[Session],
) -> None:
    run_id = mismatch_run(session_factory, steps=5)
    figures = stored_figures(session_factory, run_id)
    known = [f for f in figures.values() if f["abs_diff_max"] is not None]
    assert known and len(known) < len(figures)  # rollouts without a generator side are NULL
    for f in figures.values():
        assert (f["column_diff"], f["column_ratio"]) == (f["abs_diff_max"], f["log_seq_ratio"])
    # the drift grows with the step (mismatch_support): so does the typical largest |Δlogp|
    by_step = {s: median(f["column_diff"] for f in known if f["step"] == s) for s in (1, 5)}
    assert by_step[5] > by_step[1]


def test_every_write_path_stores_the_same_figures(
    session_factory: sessionmaker[Session], client: TestClient, tmp_path: Path
) -> None:
    """The store's (the callback's writer), the HTTP wire's (a remote recorder) and an export's
    import: the same rollouts, the same columns, to the last bit."""
    records = mismatch_steps(steps=3, seed=4)
    local = mismatch_run(session_factory, records=records)
    remote = record_run(client, "mismatch-wire-0001", CONTROL_TOKENS)
    sent = np.zeros(0, np.int64)
    for record in records:
        encoded = wire.encode_step(record, CONTROL_TOKENS, sent)
        answer = client.post(f"/api/record/runs/{remote}/steps", content=wire.body([encoded.frame]))
        assert answer.status_code == 200, answer.text
        sent = np.union1d(sent, encoded.new_ids)
    path = tmp_path / "run.jsonl"
    with session_scope(session_factory) as session:
        path.write_bytes(b"".join(export.export_chunks(session, run_id=local, fmt="jsonl")))
    imported = importer.import_export(session_factory, path).run_id
    want = _columns(session_factory, local)
    assert any(d is not None for d, _ in want.values())
    assert _columns(session_factory, remote) == want
    assert _columns(session_factory, imported) == want


def test_the_migration_backfills_what_the_writer_writes(
    engine: Engine, session_factory: sessionmaker[Session]
) -> None:
    """0021 reads both blobs of every rollout, more than one batch of them (2,000), and fills
    the columns as the writer does; where retention dropped the arrays it has nothing to read:
    NULL."""
    big = mismatch_run(session_factory, steps=3, groups=45, group_size=16, generator="all")
    kept = mismatch_run(session_factory, steps=6, seed=2, keep_tokens_every=4)
    written = {run: _columns(session_factory, run) for run in (big, kept)}
    assert len(written[big]) > 2000
    with session_scope(session_factory) as session:
        dropped = {
            (r.step, r.group, r.index)
            for r, _ in store.iter_rollouts(session, run_id=kept)
            if not r.tokens_kept
        }
    assert dropped and any(written[kept][k][0] is not None for k in dropped)
    downgrade(engine, "0020")
    upgrade(engine)
    assert _columns(session_factory, big) == written[big]
    backfilled = _columns(session_factory, kept)
    for key, value in written[kept].items():
        assert backfilled[key] == ((None, None) if key in dropped else value), key


@pytest.fixture
def explored(session_factory: sessionmaker[Session]) -> tuple[int, list[dict[str, Any]]]:
    run_id = mismatch_run(session_factory, steps=5, seed=9)
    return run_id, list(stored_figures(session_factory, run_id).values())


def _ratio(row: dict[str, Any]) -> float | None:
    log = row["log_seq_ratio"]
    return None if log is None else math.exp(log)


FILTERS: list[tuple[str, Any]] = [
    ("diff_min=0.3", lambda r: r["abs_diff_max"] is not None and r["abs_diff_max"] >= 0.3),
    ("diff_max=0.1", lambda r: r["abs_diff_max"] is not None and r["abs_diff_max"] <= 0.1),
    (
        "diff_min=0.05&diff_max=0.4&steps=2:4",
        lambda r: (
            r["abs_diff_max"] is not None
            and 0.05 <= r["abs_diff_max"] <= 0.4
            and 2 <= r["step"] <= 4
        ),
    ),
    ("ratio_min=0.9&ratio_max=1.1", lambda r: _ratio(r) is not None and 0.9 <= _ratio(r) <= 1.1),
    ("ratio_min=1.5", lambda r: _ratio(r) is not None and _ratio(r) >= 1.5),
    ("ratio_max=0.5", lambda r: _ratio(r) is not None and _ratio(r) <= 0.5),
]


@pytest.mark.parametrize(("query", "keep"), FILTERS, ids=[f for f, _ in FILTERS])
def test_each_filter_matches_the_brute_force_answer(
    session_factory: sessionmaker[Session], explored: Any, query: str, keep: Any
) -> None:
    run_id, truth = explored
    expected = sorted((r["step"], r["id"]) for r in truth if keep(r))
    assert expected and len(expected) < len(truth)
    with client_for(session_factory) as client:
        rows, _ = explorer_pages(client, f"/api/runs/{run_id}/rollouts?{query}&limit=6")
    assert [(r["step"], r["id"]) for r in rows] == expected
    by_id = {r["id"]: r for r in truth}
    for row in rows:
        assert row["abs_diff_max"] == by_id[row["id"]]["abs_diff_max"]
        assert row["log_seq_ratio"] == by_id[row["id"]]["log_seq_ratio"]


@pytest.mark.parametrize("order", ["asc", "desc"])
@pytest.mark.parametrize(
    ("sort", "key"), [("abs_diff_max", "abs_diff_max"), ("seq_ratio", "log_seq_ratio")]
)
def test_each_sort_pages_through_every_row_nulls_at_the_end_going_down(
    session_factory: sessionmaker[Session], explored: Any, sort: str, key: str, order: str
) -> None:
    """By value then id (both reversed going down); the rollouts without a generator side
    (NULL) first going up and last going down, as the explorer's other nullable sorts."""
    run_id, truth = explored
    down = order == "desc"
    present = sorted(
        (r for r in truth if r[key] is not None), key=lambda r: (r[key], r["id"]), reverse=down
    )
    nulls = sorted((r for r in truth if r[key] is None), key=lambda r: r["id"], reverse=down)
    assert present and nulls
    expected = [r["id"] for r in (present + nulls if down else nulls + present)]
    with client_for(session_factory) as client:
        rows, _ = explorer_pages(
            client, f"/api/runs/{run_id}/rollouts?sort={sort}&order={order}&limit=7"
        )
    assert [r["id"] for r in rows] == expected


def test_the_explorer_says_whether_the_run_has_a_generator_side(
    session_factory: sessionmaker[Session], explored: Any
) -> None:
    run_id, _ = explored
    plain = make_run(session_factory, steps=2)
    with client_for(session_factory) as client:
        assert client.get(f"/api/runs/{run_id}/rollouts").json()["generator_side"] is True
        assert client.get(f"/api/runs/{plain}/rollouts").json()["generator_side"] is False
        bad = client.get(f"/api/runs/{run_id}/rollouts?ratio_min=0")
        assert bad.status_code == 422 and "ratio_min" in bad.text
