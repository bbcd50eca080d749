"""A script's writer while its database link hangs (bench/tcp_proxy.py's `hold`: nothing reset,
nothing answered, as when a switch fails): the writer's thread waits inside a write, and the
steps the training hands over meanwhile stay within the byte budget (the oldest lose their
rollouts, then go whole), instead of piling up in memory until the link comes back or the kernel
gives up on it. Once it is back every step is written, with what was dropped counted on the run."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
from rollout_lens.server.core.records import StepRecord
from rollout_lens.trainer.recorder.sink_process import script_sink
from rollout_lens.trainer.recorder.writer import (
    LIGHT_BYTES,
    Backlog,
    BufferAndDrop,
    StepWriter,
    lighten_record,
    record_size,
)

from bench.tcp_proxy import database_proxy
from tests.factories import load_run, recorder_spec, seeded_step
from tests.waiting import until

STEPS = 30
BUDGET_STEPS = 4  # the budget, in steps of this test's size


def _step(step: int) -> StepRecord:
    return seeded_step(step, completion="x" * 20_000)  # some 80 KB a step


@pytest.mark.postgres
@pytest.mark.parametrize("process", [False, True], ids=["thread", "child"])
def test_a_hung_link_holds_the_budget_and_writes_every_step_once_back(
    pg_database_url: str, _pg_reset: Callable[[], None], process: bool
) -> None:
    _pg_reset()
    proxy, via_proxy = database_proxy(pg_database_url)
    proxy.start()
    budget = BUDGET_STEPS * record_size(_step(1))
    spec = recorder_spec("hung", total_steps=STEPS)
    sink = script_sink(via_proxy, process=process, spec=spec, price=0.0, wait_ms=0, resume=None)
    # as StepWriter.for_script makes it, without heartbeats: the writer's thread waits in the
    # write of step 2, not in a heartbeat sent before it
    writer = StepWriter(
        sink,
        policy=BufferAndDrop(max_bytes=budget),
        prepare=lambda raw: raw,  # and the default lighten: lighten_record
        heartbeat_seconds=None,
    )
    alive: list[weakref.ref[object]] = []  # every rollout handed over: which are still held

    def put(step: int) -> None:
        record = _step(step)
        alive.extend(weakref.ref(r) for r in record.rollouts)
        writer.put(record)

    try:
        put(1)
        until(lambda: writer.written_steps == 1, "step 1 written")
        proxy.hold()  # the link hangs: what is sent stays in it
        put(2)
        until(lambda: not writer.backlog.inbox, "step 2 taken by the writer's thread")
        for step in range(3, STEPS + 1):  # the writer's thread waits in step 2's write
            put(step)
        gc.collect()
        held = sum(ref() is not None for ref in alive)
        # step 2 (in the write) and the newest steps that fit the budget with the others light
        assert held <= 4 * (1 + BUDGET_STEPS), held
        dropped = writer.dropped_rollouts
        assert dropped >= 4 * (STEPS - 2 - BUDGET_STEPS) and writer.dropped_steps == 0
        assert writer.written_steps == 1  # it did wait: nothing got through the held link
    finally:
        proxy.release()
    try:
        assert writer.close() is True
    finally:
        proxy.close()

    run, rows, steps, _ = load_run(pg_database_url, writer.run_id)
    assert [s.step for s in steps] == list(range(1, STEPS + 1))  # every step, once
    assert all(s.reward_mean == 0.5 for s in steps)  # each with its values
    kept = sorted({r["step"] for r in rows})
    light = STEPS - 2 - (len(kept) - 2)
    # the oldest of those handed over during the hang lost their rollouts, the newest kept theirs
    assert kept == [1, 2, *range(STEPS - len(kept) + 3, STEPS + 1)], kept
    assert run.dropped_rollouts == dropped == 4 * light and run.dropped_steps == 0
    assert len(rows) == 4 * len(kept)


def _backlog(budget: int) -> Backlog:
    return Backlog(BufferAndDrop(max_bytes=budget), forget=lambda: None)


def test_the_inbox_counts_each_step_at_the_last_prepared_ones_size() -> None:
    size = record_size(_step(1))
    backlog = _backlog(3 * size)
    first = _step(1)
    backlog.arrive(first, lighten_record)
    backlog.take(backlog.inbox[0], first, backlog.prepared(first, lambda raw: raw))
    assert backlog.step_bytes == size and backlog.inbox_bytes == 0
    for step in range(2, 6):  # four steps of `size` against a budget of three
        backlog.arrive(_step(step), lighten_record)
    assert [a.raw.step for a in backlog.inbox] == [2, 3, 4, 5]
    # three whole and one light would be over the budget by the light one: two go light
    assert [bool(a.raw.rollouts) for a in backlog.inbox] == [False, False, True, True]
    assert backlog.dropped_rollouts == 8 and backlog.dropped_steps == 0
    assert backlog.inbox_bytes == 2 * LIGHT_BYTES + 2 * size <= 3 * size


def test_past_the_budget_with_every_step_light_the_oldest_go_whole() -> None:
    backlog = _backlog(3 * LIGHT_BYTES)
    first = _step(1)
    backlog.arrive(first, lighten_record)
    backlog.take(backlog.inbox[0], first, backlog.prepared(first, lambda raw: raw))
    for step in range(2, 10):
        backlog.arrive(_step(step), lighten_record)
    assert [a.raw.step for a in backlog.inbox] == [7, 8, 9]  # the oldest went whole
    assert backlog.dropped_steps == 5 and backlog.inbox_bytes <= 3 * LIGHT_BYTES
    # every one of 2-9 was lightened first; step 1, prepared, was over the budget alone
    assert not backlog.pending[0].record.rollouts
    assert backlog.dropped_rollouts == 4 * 9


def test_a_step_lightened_while_it_was_prepared_keeps_its_rollouts() -> None:
    """The writer's thread read a step's whole form and prepared it while `put` lightened the
    inbox's copy: the prepared step is whole, so its rollouts are not counted as dropped."""
    size = record_size(_step(1))
    backlog = _backlog(3 * size - 1)
    first = _step(1)
    backlog.arrive(first, lighten_record)
    backlog.take(backlog.inbox[0], first, backlog.prepared(first, lambda raw: raw))
    backlog.arrive(_step(2), lighten_record)
    arrival = backlog.inbox[0]
    read = arrival.raw  # the writer's thread takes it to prepare
    backlog.arrive(_step(3), lighten_record)
    backlog.arrive(_step(4), lighten_record)  # over the budget: step 2 is lightened in the inbox
    assert arrival.raw is not read and backlog.dropped_rollouts == 4
    backlog.take(arrival, read, backlog.prepared(read, lambda raw: raw))
    assert backlog.dropped_rollouts == 0
    assert [len(p.record.rollouts) for p in backlog.pending] == [4, 4]


def test_a_step_that_cannot_be_lightened_is_never_dropped_at_put() -> None:
    """Steps `lighten` cannot read (not StepRecords, for lighten_record) stay whole past the
    budget: a step is never dropped with its rollouts uncounted."""
    first = _step(1)
    backlog = _backlog(record_size(first))
    backlog.arrive(first, lighten_record)
    backlog.take(backlog.inbox[0], first, backlog.prepared(first, lambda raw: raw))
    for step in range(2, 6):
        backlog.arrive({"step": step}, lighten_record)
    assert [a.raw["step"] for a in backlog.inbox] == [2, 3, 4, 5]
    assert backlog.dropped_steps == backlog.dropped_rollouts == 0
