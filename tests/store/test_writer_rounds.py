"""A script's writer (BufferAndDrop) takes the steps handed over in rounds, at most every
DRAIN_SECONDS, not at every step: woken by each one, its thread took the GIL at every training
step's start. It still takes them at once where waiting would cost: a run's first step, a
quarter of the budget handed over, a flush (a checkpoint) and a close. A launched run's writer
(WaitThenFail, its commits in the training process) writes in the same rounds: at once for its
first step, a quarter of `max_pending` waiting (where `put` blocks), a flush and a close."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server import store
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.trainer.recorder import writer as writer_module
from rollout_lens.trainer.recorder.writer import StepWriter, record_size

from tests.factories import assert_every_step_written, script_writer, seeded_step
from tests.waiting import returns, until

STEP_SECONDS = 0.01  # a toy training step's time between two steps handed over


def _counted(writer: StepWriter, made: list[StepWriter]) -> tuple[StepWriter, list[list[int]]]:
    """`writer`, each of its sink's writes' steps counted in the list returned with it; kept in
    `made` to be closed."""
    writes: list[list[int]] = []
    write = writer.sink.write

    def counted(records: Any, *args: Any, **kwargs: Any) -> Any:
        writes.append([r.step for r in records])
        return write(records, *args, **kwargs)

    writer.sink.write = counted  # type: ignore[method-assign]
    made.append(writer)
    return writer, writes


@pytest.fixture
def make_writer(tmp_path: Path) -> Iterator[Any]:
    """A script's writer on a fresh SQLite file (the sink in this process), each sink write's
    steps counted in `writes`; closed at the end."""
    made: list[StepWriter] = []

    def make(max_bytes: int = 256 * 2**20) -> tuple[StepWriter, list[list[int]]]:
        writer = script_writer(
            f"sqlite:///{tmp_path / 'lens.db'}",
            "rounds",
            total_steps=40,
            max_bytes=max_bytes,
            heartbeat_seconds=600.0,  # no beat wakes the writer while a test waits
        )
        return _counted(writer, made)

    yield make
    for writer in made:
        writer.close()


@pytest.fixture
def launched_writer(migrated_sqlite: Any, tmp_path: Path) -> Iterator[Any]:
    """A launched run's writer (the worker's, WaitThenFail) of a run made for it in a fresh
    SQLite file (the sink in this process), each sink write's steps counted; closed at the
    end."""
    engine = make_engine(migrated_sqlite(tmp_path / "launched.db"))
    factory = make_session_factory(engine)
    made: list[StepWriter] = []

    def make(max_pending: int = 64) -> tuple[StepWriter, list[list[int]]]:
        with session_scope(factory) as session:
            run_id = store.create_run(
                session, name="rounds", model="m", total_steps=40, group_size=4
            ).id
        writer = StepWriter.for_launched(
            factory,
            run_id=run_id,
            control_tokens=[],
            price_per_device_hour=0.0,
            max_pending=max_pending,
            process=False,  # the rounds are the writer's: its sink here, as the script's
        )
        return _counted(writer, made)

    yield make
    for writer in made:
        writer.close()
    engine.dispose()


@pytest.mark.parametrize("maker", ["make_writer", "launched_writer"])
def test_steps_handed_over_faster_than_a_round_are_written_together(
    maker: str, request: pytest.FixtureRequest
) -> None:
    writer, writes = request.getfixturevalue(maker)()  # a script's, a launched run's
    writer.put(seeded_step(1))
    until(lambda: writer.written_steps == 1, "the first step, written at once")
    for step in range(2, 22):
        writer.put(seeded_step(step))
        time.sleep(STEP_SECONDS)
    until(lambda: writer.written_steps == 21, "every step written")
    later = [batch for batch in writes if batch != [1]]
    # 20 steps over ~0.2 s: one round, two at a round's edge; woken by every step, about 20
    assert 1 <= len(later) <= 3, writes
    assert [s for batch in later for s in batch] == list(range(2, 22))  # in order


def test_a_quarter_of_the_budget_is_taken_at_once(
    make_writer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "DRAIN_SECONDS", 600.0)  # no round before the test ends
    size = record_size(seeded_step(1))
    writer, _ = make_writer(max_bytes=3 * size)  # a step handed over is past a quarter of it
    writer.put(seeded_step(1))
    until(lambda: writer.written_steps == 1, "the first step")
    writer.put(seeded_step(2))
    until(lambda: writer.written_steps == 2, "the second step, past a quarter of the budget")
    assert writer.dropped_steps == writer.dropped_rollouts == 0


@pytest.mark.parametrize("maker", ["make_writer", "launched_writer"])
def test_a_flush_and_a_close_take_what_waits_at_once(
    maker: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(writer_module, "DRAIN_SECONDS", 600.0)  # no round before the test ends
    writer, writes = request.getfixturevalue(maker)()
    writer.put(seeded_step(1))
    until(lambda: writer.written_steps == 1, "the first step")
    writer.put(seeded_step(2))
    assert writer.written_steps == 1  # waiting for a round that will not come
    returns(writer.flush, "a flush with a step waiting", 30)
    assert writer.written_steps == 2
    writer.put(seeded_step(3))
    assert returns(writer.close, "a close with a step waiting", 30) is True
    assert writes == [[1], [2], [3]]
    if maker == "make_writer":  # a script's writer ends its run (a launched run's worker does)
        assert_every_step_written(f"sqlite:///{tmp_path / 'lens.db'}", writer.run_id, 3)


def test_a_launched_run_writes_a_quarter_of_max_pending_at_once(
    launched_writer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "DRAIN_SECONDS", 600.0)
    writer, writes = launched_writer(max_pending=8)
    writer.put(seeded_step(1))
    until(lambda: writer.written_steps == 1, "the first step")
    writer.put(seeded_step(2))
    assert writer.written_steps == 1  # waiting for a round that will not come
    writer.put(seeded_step(3))  # two waiting: a quarter of max_pending
    until(lambda: writer.written_steps == 3, "two steps waiting, a quarter of max_pending")
    assert writes == [[1], [2, 3]]
