"""A run at the series-name cap reads whole: every name's values from `/api/runs/{id}/series`
and a chart for each on the run page, on both databases (`bench/series_names.py` prints how the
time grows with the names; here only what comes back is checked)."""

from __future__ import annotations

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.core.vocab import MAX_SERIES_PER_RUN
from rollout_lens.server.store.db import session_scope
from sqlalchemy.orm import Session, sessionmaker

from bench import series_names as bench
from tests.web_support import client_for, parse

STEPS = 3


def _value(step: int, i: int) -> float:
    return (step * 7 + i) % 13 / 13


def test_a_run_at_the_cap_reads_every_series(session_factory: sessionmaker[Session]) -> None:
    run_id = bench.write_run(session_factory, names=MAX_SERIES_PER_RUN, steps=STEPS)
    with client_for(session_factory) as client:
        full = client.get(f"/api/runs/{run_id}/series?full=1").json()["series"]
        page = client.get(f"/runs/{run_id}")
    names = [f"user/{i:05d}" for i in range(MAX_SERIES_PER_RUN)]
    assert set(names) <= set(full)
    for i, name in enumerate(names):
        assert full[name]["x"] == list(range(1, STEPS + 1))
        assert full[name]["y"] == pytest.approx([_value(s, i) for s in range(1, STEPS + 1)])
    assert page.status_code == 200
    other = parse(page.text).json("page-data")["figures"]["other"]
    assert sum(len(group["figures"]) for group in other) == MAX_SERIES_PER_RUN


def test_the_series_bench_runs_and_prints_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--steps", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count(" names ") == 3 * len(bench.SIZES) and "run page" in out


def test_the_cap_holds_for_a_run_recorded_step_by_step(
    session_factory: sessionmaker[Session],
) -> None:
    run_id = bench.write_run(session_factory, names=MAX_SERIES_PER_RUN - 1, steps=1)
    with session_scope(session_factory) as session:
        record = StepRecord(2, 2, {}, metrics={"late/a": 1.0, "late/b": 2.0})
        store.record_step(session, run_id=run_id, record=record, control_tokens=())
        names = store.series_names(session, run_id=run_id)
    assert len(names) == MAX_SERIES_PER_RUN and names[-1] == "late/a"
