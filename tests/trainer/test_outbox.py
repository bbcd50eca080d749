"""The writer under a user's script (BufferAndDrop) on its own: steps in, a run and its steps out,
never an exception."""

from __future__ import annotations

import logging
import random
import threading

import pytest
from rollout_lens.server.core.records import StepRecord
from rollout_lens.trainer.recorder.writer import RunSpec, StepWriter, record_size

from tests.factories import CONTROL_TOKENS, load_run, make_rollouts
from tests.waiting import returns


def _spec() -> RunSpec:
    return RunSpec(
        name="outbox",
        model="m",
        total_steps=3,
        group_size=8,
        prompts_per_step=1,
        seed=0,
        config={"project": "p"},
        control_tokens=list(CONTROL_TOKENS),
        device="cpu",
        notes=["a note"],
    )


def _step(step: int, **meta: object) -> StepRecord:
    rollouts = make_rollouts(random.Random(step), group_size=8, listed=4)
    for r in rollouts:
        r.meta.update(meta)
    return StepRecord(
        step=step,
        rollout_step=step,
        values={"reward_mean": 0.5, "wall_time": 0.1},
        rollouts=rollouts,
    )


def test_steps_in_run_out(sqlite_url: str) -> None:
    outbox = StepWriter.for_script(database_url=sqlite_url, spec=_spec(), prepare=lambda raw: raw)
    for step in (1, 2, 3):
        outbox.put(_step(step))
    assert outbox.close() is True
    run, rows, steps, _ = load_run(sqlite_url, outbox.run_id)
    assert run.status == "completed" and run.source == "callback" and run.notes == ["a note"]
    assert [s.step for s in steps] == [1, 2, 3] and len(rows) == 24
    assert run.dropped_steps == 0 and run.device_seconds == pytest.approx(0.3)


@pytest.mark.postgres
def test_a_refused_step_is_dropped_and_counted_the_others_go_on(
    pg_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.trainer.test_callback import _empty

    _empty(pg_database_url)
    caplog.set_level(logging.WARNING, logger="rollout_lens")
    outbox = StepWriter.for_script(
        database_url=pg_database_url, spec=_spec(), prepare=lambda raw: raw
    )
    outbox.put(_step(1))
    for step in (2, 3):  # past PostgreSQL's bigint: refused (not a connection's trouble)
        too_big = _step(step)
        too_big.rollout_step = 2**63
        outbox.put(too_big)
    outbox.put(_step(4))
    assert outbox.close() is True
    run, _, steps, _ = load_run(pg_database_url, outbox.run_id)
    assert [s.step for s in steps] == [1, 4]
    assert run.dropped_steps == 2 and run.status == "completed"
    said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(said) == 1 and "step 2" in said[0]


def test_series_names_past_the_cap_are_left_out_with_a_warning_the_step_is_kept(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A script logging more series names than a run holds: the first MAX_SERIES_PER_RUN are
    recorded, one warning names the step, and the step itself (values, rollouts, the names that
    fit) and every later step are recorded; nothing is dropped."""
    from rollout_lens.server.core.vocab import MAX_SERIES_PER_RUN

    caplog.set_level(logging.WARNING, logger="rollout_lens")
    outbox = StepWriter.for_script(database_url=sqlite_url, spec=_spec(), prepare=lambda raw: raw)
    many = _step(1)
    many.metrics = {f"user/{i:05d}": float(i) for i in range(MAX_SERIES_PER_RUN + 500)}
    later = _step(2)
    later.metrics = {"user/00000": 7.0, "user/01400": 8.0}
    outbox.put(many)
    outbox.put(later)
    assert outbox.close() is True
    run, rows, steps, series = load_run(sqlite_url, outbox.run_id)
    assert [s.step for s in steps] == [1, 2] and len(rows) == 16
    assert run.dropped_steps == 0 and run.dropped_rollouts == 0
    assert len(series) == MAX_SERIES_PER_RUN
    assert series["user/00000"] == [(1, 0.0), (2, 7.0)] and "user/01400" not in series
    warned = [
        r.getMessage() for r in caplog.records if "series names not recorded" in r.getMessage()
    ]
    assert len(warned) == 1 and "step 1: 500 new series names" in warned[0]


def test_a_prepare_error_drops_that_step_only(sqlite_url: str) -> None:
    def prepare(raw: object) -> StepRecord:
        if raw == "bad":
            raise ValueError("a user's vote function broke")
        assert isinstance(raw, StepRecord)
        return raw

    outbox = StepWriter.for_script(database_url=sqlite_url, spec=_spec(), prepare=prepare)
    for raw in (_step(1), "bad", _step(3)):
        outbox.put(raw)
    outbox.close()
    run, _, steps, _ = load_run(sqlite_url, outbox.run_id)
    assert [s.step for s in steps] == [1, 3] and run.dropped_steps == 1


def test_flush_waits_for_the_step_the_writer_is_preparing(sqlite_url: str) -> None:
    """A step the writer's thread has taken to prepare is still waiting: flush (a checkpoint's,
    a script's last call before it dies) returns once it is written, not while the inbox and
    the prepared steps are both empty (CI lost steps 2 and 3 of a script killed after its
    flush: the thread had taken them and was preparing them)."""
    entered, release = threading.Event(), threading.Event()

    def prepare(raw: object) -> StepRecord:
        assert isinstance(raw, StepRecord)
        if raw.step == 2:
            entered.set()
            release.wait(60)
        return raw

    outbox = StepWriter.for_script(database_url=sqlite_url, spec=_spec(), prepare=prepare)
    outbox.put(_step(1))
    returns(outbox.flush, "the first flush")
    outbox.put(_step(2))
    assert entered.wait(60), "the writer never took step 2"
    flushed = threading.Thread(target=outbox.flush, daemon=True)
    flushed.start()
    flushed.join(0.5)  # long enough for a flush that sees nothing waiting to return
    assert flushed.is_alive(), "flush returned while step 2 was being prepared"
    release.set()
    flushed.join(60)
    assert not flushed.is_alive()
    _, _, steps, _ = load_run(sqlite_url, outbox.run_id)
    assert [s.step for s in steps] == [1, 2]  # written before flush returned
    assert outbox.close() is True


def test_record_size_grows_with_rollouts() -> None:
    full = _step(1)
    empty = StepRecord(step=1, rollout_step=1, values=full.values)
    per_rollout = [300 + len(r.completion) + 8 * len(r.completion_ids) for r in full.rollouts]
    assert record_size(full) - record_size(empty) >= sum(per_rollout)


def test_record_size_is_what_a_step_really_holds() -> None:
    """The buffer's bound is in real bytes: a step of 64 rollouts × 512 tokens as Python lists,
    measured by tracemalloc while it is built, is what record_size says, within a quarter."""
    import tracemalloc

    rng = random.Random(9)
    tracemalloc.start()
    try:
        rollouts = []
        for group in range(8):
            for r in make_rollouts(rng):
                n = 512
                r.group = group
                r.completion_ids = [rng.randrange(1_000, 150_000) for _ in range(n)]
                r.tokens = [f" w{i}" for i in r.completion_ids]
                r.completion = "".join(r.tokens)
                r.token_logprobs = [-rng.random() for _ in range(n)]
                r.control_probs = {t: [rng.random() for _ in range(n)] for t in CONTROL_TOKENS}
                rollouts.append(r)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    estimate = record_size(StepRecord(step=1, rollout_step=1, values={}, rollouts=rollouts))
    assert 0.75 * held <= estimate <= 1.25 * held, (estimate, held)
