"""The one writer: every recorded step reaches its store through a StepWriter.

A StepWriter is a queue: it owns the writer thread, the steps waiting, the byte budget, the
drops and the retries; where the steps go is its sink (trainer/recorder/sinks.py): the
database (SqlSink, through the store's one writer, store.RunWriter: the same as every
import's) or a dashboard's recording API (HttpSink, trainer/recorder/remote.py). A sink does
four things (create or continue the run, write steps, beat the heartbeat, finish the run); it
raises SinkAway when its store cannot be reached (retried with one Backoff,
server/core/retry.py), RunEnded when the run ended elsewhere, and anything else to stop.

Steps are written off the training thread, in order, by a daemon thread; the steps waiting when
it wakes go to the sink together (up to BATCH_STEPS; one step each when training is slower than
writing). A step is written once: a batch the store took but whose answer was lost is
recognised on the retry (the database sink asks which of its steps the run has; over HTTP, by
the steps' keys and the step numbers the dashboard answers).

What differs between runs is what to do while the store is away, a policy:

- BufferAndDrop, a user's TRL script (RolloutLensCallback): `put` never blocks and never
  raises. Steps wait in memory up to a byte budget; past it the oldest steps lose their rollouts
  first (their per-step values are kept), then whole steps go; a step the store refuses, or
  whose preparation raises, is dropped alone. Steps handed over while the writer's thread is
  held by a write that does not return (a database link that hangs rather than fails) count
  against the budget too, each at the size of the last step prepared: past it the oldest of
  them lose their rollouts at `put` (`lighten`; the values judged from the rollouts go with
  them, TRL's logs and what `lighten` keeps stay), then go whole, so that a hung link never
  holds more than the budget. What was dropped is counted on the run, problems
  are logged once, and training goes on whatever happens. The sink creates the run when the
  store first answers, beats its heartbeat and marks it finished at `close`. A run that
  ended elsewhere (cancelled from the dashboard: server/store/ending.py) records nothing more:
  what waits is dropped, and on a cancel `stop_requested` tells the callback to stop training.
- WaitThenFail, a run launched from the dashboard (the worker owns the run row, its heartbeat
  and its end): steps are judged on the training thread (the task's judge) and read by the
  database sink on the writer's thread (sinks.reads_steps), in rounds as a script's steps
  are taken (DRAIN_SECONDS: the writer's commits share the training process), at most
  `max_pending` wait (then `put` blocks: training pauses), a database that stays away longer
  than `give_up_after` seconds (ROLLOUT_LENS_LOST_AFTER_SECONDS: the dashboard calls a silent
  worker lost then too) or a step it refuses fails the run: the error is raised on the
  training thread at the next `put`, `flush` or `close`, so a run never trains on while its
  records are lost and the recorded steps never have a gap.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_lens.server import store
from rollout_lens.server.core.errors import RunEnded
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.core.retry import Backoff, retry
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunSource, RunStatus, dashboard_caller
from rollout_lens.trainer.recorder.reading import JudgedStep, StepReader
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:
    from rollout_lens.trainer.recorder.sinks import Sink

log = logging.getLogger("rollout_lens")

BATCH_STEPS = 32  # steps written per transaction (a backlog drains in few commits)
# The writer's thread takes the steps handed over at most this often (and at once while it has
# prepared none, past a quarter of the budget or of `max_pending`, or when asked to flush or
# close). Woken by every step, it took the GIL from the training thread at every step's start,
# and the child's commit came with it: bench.overhead_script's toy step 1.114 against 1.051
# waking every 0.5 s (6 pairs, every pair lower). A launched run's writer, whose commits share
# the training process, writes in the same rounds. A step reaches the dashboard up to this much
# later.
DRAIN_SECONDS = 0.5
RETRY_MAX_SECONDS = 15.0  # a busy dashboard's Retry-After, at most
FINISH_GIVE_UP_SECONDS = 60.0  # at least: a run's end (and why) is worth waiting for

T = TypeVar("T")


@dataclass(frozen=True)
class BufferAndDrop:
    """A user's script: never stop training; keep at most `max_bytes` of steps in memory."""

    max_bytes: int = 256 * 2**20


@dataclass(frozen=True)
class WaitThenFail:
    """A launched run: pause training while the database is away, fail after `give_up_after`."""

    give_up_after: float = 60.0
    max_pending: int = 64


Policy = BufferAndDrop | WaitThenFail


@dataclass
class RunSpec:
    """What the run row says about a run the writer creates (a user's script)."""

    name: str
    model: str
    total_steps: int
    group_size: int
    prompts_per_step: int
    seed: int
    config: dict[str, Any]
    control_tokens: list[str]
    device: str
    source: RunSource = RunSource.callback
    notes: list[str] = field(default_factory=list)
    keep_tokens_every: int | None = None


class DatabaseAway(RuntimeError):
    """The database stayed unreachable (or unwritable) for longer than the caller waits."""


class SinkAway(Exception):
    """The sink's store cannot take the steps now: retried with the writer's backoff, or after
    the Retry-After a busy dashboard asks for."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class OutOfTime(Exception):
    """close's timeout has run out: nothing more is sent but the run's end."""


@dataclass
class Wrote:
    """What a sink's `write` did with the steps waiting: the first `taken` are in the store
    (`written` of them by this call, the others were there already); `refused`, the reason the
    store refuses the step after them (None: it was not tried yet)."""

    taken: int
    written: int
    refused: BaseException | None = None
    # the steps as written, where the sink read them from judged ones in this process (a
    # launched run's: what `on_written` is handed); None: as they were handed over
    records: list[StepRecord] | None = None


@dataclass
class Pending:
    record: StepRecord
    size: int  # approximate bytes held


@dataclass(eq=False)
class Arrival:
    """A step handed over (`raw`, not yet prepared) and the bytes it is counted at; `light`:
    `lighten` took its rollouts off (`dropped` of them)."""

    raw: Any
    size: int
    light: bool = False
    dropped: int = 0


# What a step without its rollouts is counted at, not yet prepared (its logs and timings).
LIGHT_BYTES = 2048


def lighten_record(raw: Any) -> tuple[Any, int]:
    """A StepWriter's `lighten` for steps handed over as StepRecords (prepare: as they are): the
    step without its rollouts, and how many it had; anything else is given back as it is (it
    cannot be made lighter, so it is neither lightened nor dropped at `put`)."""
    if isinstance(raw, StepRecord):
        return dataclasses.replace(raw, rollouts=[]), len(raw.rollouts)
    return raw, 0


# A token's text as a Python str in a list: an 8-byte pointer plus the object, ~49 bytes and its
# characters. The numbers are numpy arrays (8 bytes a value): at 512 rollouts × 1,024 tokens × 4
# control tokens a step holds ~25 MB of them, where the Python lists it once was took ~140 MB.
_TEXT = 8 + 49


def record_size(record: StepRecord) -> int:
    """Approximate bytes a step holds in memory (dominated by its rollouts' arrays and token
    texts)."""
    size = 200 + 40 * (len(record.values) + len(record.metrics))
    for r in record.rollouts:
        size += 300 + len(r.completion) + len(r.prompt) // 8  # prompts are shared between rollouts
        size += r.completion_ids.nbytes + r.token_logprobs.nbytes
        if r.generator_logprobs is not None:
            size += r.generator_logprobs.nbytes
        control = r.control_probs
        size += control.array.nbytes
        if r.tokens:
            size += len(r.tokens) * _TEXT + sum(map(len, r.tokens))
    if isinstance(record, JudgedStep):  # read where it is written: its texts are in its Samples
        size += record.text_bytes
    return size


class Backlog:
    """The steps waiting for the sink: handed over (`inbox`, not yet prepared), prepared
    (`pending`, oldest first) within a byte budget, and what was dropped. Held under the
    writer's lock."""

    def __init__(self, policy: Policy, forget: Callable[[], None]) -> None:
        self.policy = policy
        self.waits = isinstance(policy, WaitThenFail)  # a launched run's: prepared at `put`
        # None: no budget (a launched run's `put` blocks instead)
        self.max_bytes = policy.max_bytes if isinstance(policy, BufferAndDrop) else None
        self.forget = forget  # the sink's: steps left unwritten
        self.inbox: deque[Arrival] = deque()
        self.inbox_bytes = 0
        self.step_bytes = 0  # the last whole step prepared: what a step handed over counts
        self.pending: deque[Pending] = deque()
        self.bytes = 0
        self.dropped_steps = 0
        self.dropped_rollouts = 0
        self.last_round = 0.0  # when the writer last took the inbox (monotonic)

    def __len__(self) -> int:
        return len(self.pending) + len(self.inbox)

    def due(self) -> bool:
        """Whether the steps handed over want the writer now, not at its next round: none
        prepared yet (a run's first step, its size unknown), or past a quarter of the budget."""
        over = self.max_bytes is not None and 4 * self.inbox_bytes > self.max_bytes
        return over or not self.step_bytes

    def taking(self, hurry: bool) -> bool:
        """Whether the writer takes the steps handed over now: `hurry` (a flush, a close),
        `due`, or DRAIN_SECONDS after its last round."""
        late = time.monotonic() - self.last_round >= DRAIN_SECONDS
        return bool(self.inbox) and (hurry or late or self.due())

    def round(self) -> list[Arrival]:
        """The steps handed over, for the writer's round (each leaves the inbox once prepared:
        `take`); a launched run's round is of the steps prepared at `put`."""
        if self.inbox or (self.waits and self.pending):
            self.last_round = time.monotonic()
        return list(self.inbox)

    def next_round(self) -> float:
        """Seconds until the writer's next round while steps wait for it (a script's handed
        over, a launched run's prepared), else DRAIN_SECONDS, or 5 s for a launched run (its
        `put` wakes the writer)."""
        if self.inbox or (self.waits and self.pending):
            return self.last_round + DRAIN_SECONDS - time.monotonic()
        return 5.0 if self.waits else DRAIN_SECONDS

    def writes_now(self, hurry: bool) -> bool:
        """Whether the steps waiting prepared are written now: a script's at once (its round is
        when the inbox is taken); a launched run's, prepared at `put`, in rounds too: its first
        step at once, on a flush or a close (`hurry`), past a quarter of `max_pending` (where
        `put` blocks), else DRAIN_SECONDS after the last round."""
        policy = self.policy
        if not self.pending or not isinstance(policy, WaitThenFail) or hurry:
            return bool(self.pending)
        late = time.monotonic() - self.last_round >= DRAIN_SECONDS
        return late or 4 * len(self.pending) >= policy.max_pending

    def prepared(self, raw: Any, prepare: Callable[[Any], StepRecord]) -> Pending | None:
        """A step handed over, prepared; None (said here, counted by the caller) when preparing
        it raises."""
        try:
            record = prepare(raw)
        except Exception as exc:  # noqa: BLE001 - a bad step must not stop the others
            log.warning("Rollout Lens: could not prepare step for recording (dropped): %s", exc)
            return None
        return Pending(record, record_size(record))

    def arrive(self, raw: Any, lighten: Callable[[Any], tuple[Any, int]]) -> None:
        """A step handed over joins the inbox; past the budget (the writer's thread held by a
        write meanwhile), the oldest steps there lose their rollouts (`lighten`: the step
        without them, and how many it had; the same object: it cannot be lightened), then the
        oldest of those that lost them go whole (a step is never dropped with its rollouts
        uncounted)."""
        arrival = Arrival(raw, self.step_bytes)
        self.inbox.append(arrival)
        self.inbox_bytes += arrival.size
        if self.max_bytes is None or self.inbox_bytes <= self.max_bytes:
            return
        for waiting in self.inbox:
            if self.inbox_bytes <= self.max_bytes:
                break
            if waiting.light:
                continue
            light, dropped = lighten(waiting.raw)
            if light is waiting.raw:
                continue
            waiting.raw, waiting.light, waiting.dropped = light, True, dropped
            self.dropped_rollouts += dropped
            light_size = min(waiting.size, LIGHT_BYTES)
            self.inbox_bytes -= waiting.size - light_size
            waiting.size = light_size
        while len(self.inbox) > 1 and self.inbox[0].light and self.inbox_bytes > self.max_bytes:
            self.inbox_bytes -= self.inbox.popleft().size
            self.dropped_steps += 1

    def take(self, arrival: Arrival, raw: Any, pending: Pending | None) -> None:
        """The inbox's first step, prepared from `raw`, moves to the steps waiting prepared
        (None: preparing it failed, dropped alone and counted); one let go of meanwhile (the
        backlog cleared: the run ended, recording stopped; or dropped whole at `put`) goes with
        the others. One lightened while it was being prepared keeps its rollouts after all (they
        are prepared: the budget of the prepared steps holds them). A step is in the inbox until
        then, so that flush() never finds neither holding it."""
        if not self.inbox or self.inbox[0] is not arrival:
            return
        self.inbox.popleft()
        self.inbox_bytes -= arrival.size
        if pending is None:
            self.dropped_steps += 1
            return
        if arrival.raw is not raw:  # lightened after it was read: the whole step was prepared
            self.dropped_rollouts -= arrival.dropped
        if pending.record.rollouts:  # a step with rollouts: what the next ones are counted at
            self.step_bytes = pending.size
        self.add(pending)

    def add(self, pending: Pending) -> None:
        self.pending.append(pending)
        self.bytes += pending.size
        if self.max_bytes is not None and self.bytes > self.max_bytes:
            self._enforce_budget(self.max_bytes)

    def _enforce_budget(self, most: int) -> None:
        """Past the budget, drop the oldest steps' rollouts first, then the oldest steps."""
        for pending in self.pending:
            if self.bytes <= most:
                break
            if pending.record.rollouts:
                self.dropped_rollouts += len(pending.record.rollouts)
                pending.record.rollouts = []
                smaller = record_size(pending.record)
                self.bytes -= pending.size - smaller
                pending.size = smaller
        while self.pending and self.bytes > most:
            self.bytes -= self.pending.popleft().size
            self.dropped_steps += 1
        self.forget()  # what the sink made of the steps waiting is to be made again

    def head(self, most: int) -> list[Pending]:
        return list(itertools.islice(self.pending, most))

    def leave(self, batch: list[Pending]) -> None:
        """The oldest waiting steps leave (written, already there, or dropped)."""
        for pending in batch:
            self.pending.popleft()
            self.bytes -= pending.size

    def clear(self) -> int:
        """Nothing waits any more; how many steps did."""
        left = len(self)
        self.pending.clear()
        self.inbox.clear()
        self.bytes = self.inbox_bytes = 0
        return left

    def drop_all(self) -> int:
        """Every step waiting dropped and counted; how many."""
        left = self.clear()
        self.dropped_steps += left
        return left

    def drops(self) -> tuple[int, int]:
        return self.dropped_steps, self.dropped_rollouts


class Outage:
    """A store that stopped answering: the backoff between tries, and what the log says when
    it goes away and when it is back (once each)."""

    def __init__(self, away: str, policy: Policy) -> None:
        self.away = away  # "the database", "the dashboard"
        self.policy = policy
        waits = policy.give_up_after if isinstance(policy, WaitThenFail) else None
        self.backoff = Backoff(give_up_after=waits)

    def down(self, exc: BaseException, what: str) -> float | None:
        """A try failed: seconds to the next, or None: a launched run gives up."""
        delay = self.backoff.failed()
        if self.backoff.attempts > 1:
            return delay
        if isinstance(self.policy, WaitThenFail):
            log.warning(
                "Rollout Lens: %s failed while %s (%s); retrying for up to %.0f s",
                self.away,
                what,
                short(exc),
                self.policy.give_up_after,
            )
        else:
            log.warning(
                "Rollout Lens: %s is unreachable (%s); training goes on and steps "
                "are kept in memory (up to %.1f MB) until it is back",
                self.away,
                short(exc),
                self.policy.max_bytes / 2**20,
            )
        return delay

    def back(self, drops: tuple[int, int]) -> None:
        down = self.backoff.succeeded()
        if down is None:
            return
        if isinstance(self.policy, WaitThenFail):
            log.warning("Rollout Lens: %s is back after %.0f s; recording goes on", self.away, down)
            return
        log.warning(
            "Rollout Lens: %s is back after %.0f s; buffered steps written "
            "(dropped so far: %d steps, %d rollouts)",
            self.away,
            down,
            *drops,
        )


def _identity(raw: Any) -> StepRecord:
    assert isinstance(raw, StepRecord)
    return raw


class Delivery:
    """The writer thread's dealings with its sink: a flush (the run, the waiting steps in
    order, the drop counts), the heartbeat, the run's end; what each answer means (a store
    away, busy, refusing a step, or a run that ended elsewhere); when to try again."""

    def __init__(
        self,
        sink: Sink,
        policy: Policy,
        backlog: Backlog,
        lock: threading.Condition,
        *,
        fail: Callable[[BaseException], None],
    ) -> None:
        self.sink = sink
        self.waits = isinstance(policy, WaitThenFail)
        self.backlog = backlog
        self.lock = lock
        self.fail = fail  # the writer's: a permanent error
        self.on_written: Callable[[StepRecord], None] | None = None
        self.outage = Outage(sink.away, policy)
        self.retry_at = 0.0
        self.written_steps = 0
        self.busy_answers = 0
        self.ended: RunEnded | None = None  # the run ended elsewhere (a cancel): no more writes
        self._refusal_said = False

    def begin(self) -> None:
        """The sink starts as the writer does (a writer process's imports begin then: a
        launched run's before the worker calls train(), a script's as training begins). A
        launched run's opens then too (a script's opens at its first step: that creates its
        run)."""
        self.sink.start()
        if self.waits:
            self.flush()

    def flush(self) -> bool:
        """Create the run if needed and write the waiting steps in order; False if the store is
        away (the steps stay) or the policy gave up."""
        try:
            self.sink.open()
            while self.backlog.pending:
                self._write_batch()
            self.sink.report_drops(self.backlog.drops())
        except OutOfTime:
            return False  # the loop drops what waits and ends the run (_out_of_time)
        except SinkAway as exc:
            if exc.retry_after is not None and self.outage.backoff.down_since is None:
                # busy, not away: try again when it says (±50%, so trainers spread out)
                wait = min(exc.retry_after, RETRY_MAX_SECONDS) * random.uniform(0.5, 1.5)
                self.retry_at = time.monotonic() + wait
                self.busy_answers += 1
                return False
            self.went_down(exc)
            return False
        except RunEnded as exc:
            self.run_ended(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - e.g. a database at a newer schema, a 401
            self.fail(exc)
            return False
        self.outage.back(self.backlog.drops())
        return True

    def _write_batch(self) -> None:
        """Hand the oldest waiting steps (up to BATCH_STEPS) to the sink; those it took leave
        the backlog, and one it refuses fails a launched run or is dropped alone."""
        with self.lock:
            batch = self.backlog.head(BATCH_STEPS)
        wrote = self.sink.write([p.record for p in batch], self.backlog.drops())
        self._leave(batch[: wrote.taken])
        self.written_steps += wrote.written
        if self.on_written is not None:
            for record in (wrote.records or [p.record for p in batch])[: wrote.taken]:
                self.on_written(record)
        if wrote.refused is None:
            return
        if self.waits:
            raise wrote.refused  # a launched run fails at the step the store refuses
        with self.lock:  # `put` counts drops too (on the training thread)
            self.backlog.dropped_steps += 1
        if not self._refusal_said:
            self._refusal_said = True
            log.warning(
                "Rollout Lens: %s refused step %d (dropped; later refusals are only counted on "
                "the run): %s",
                self.sink.away,
                batch[wrote.taken].record.step,
                short(wrote.refused),
            )
        self._leave([batch[wrote.taken]])
        self.sink.forget()

    def _leave(self, batch: list[Pending]) -> None:
        with self.lock:
            self.backlog.leave(batch)
            self.lock.notify_all()

    def heartbeat(self) -> None:
        if self.sink.run_id is None:
            return
        try:
            self.sink.heartbeat()
        except RunEnded as exc:  # a cancel is heard between slow steps too
            self.run_ended(exc)
        except OutOfTime:
            pass
        except Exception as exc:  # noqa: BLE001 - the next write will find out and buffer
            self.went_down(exc)

    def run_ended(self, exc: RunEnded) -> None:
        """The run ended elsewhere: recording stops (what waits is dropped, not counted as lost:
        the run has its end); a cancel asks the callback to stop training (stop_requested)."""
        with self.lock:
            self.ended = exc
            self.backlog.clear()
            self.lock.notify_all()
        _say_ended(exc)

    def what(self) -> str:
        """The steps being written, as an error message names them."""
        head = self.backlog.head(BATCH_STEPS)
        if not head:
            return f"recording run {self.sink.run_id}"
        first, last = head[0].record.step, head[-1].record.step
        steps = f"{first}" + (f"–{last}" if last != first else "")
        return f"recording step {steps} of run {self.sink.run_id}"

    def went_down(self, exc: BaseException) -> None:
        delay = self.outage.down(exc, self.what())
        if delay is None:
            backoff = self.outage.backoff
            self.fail(gave_up(self.what(), backoff.waited(), backoff.attempts, exc))
            return
        self.retry_at = time.monotonic() + delay


class StepWriter:
    """The queue: steps to a sink on a daemon thread, under a BufferAndDrop or WaitThenFail
    policy. Made by `for_script` (its run created in a database), `for_launched` (the worker's
    run) or remote.py's `RemoteStepWriter`; `prepare` turns what `put` is handed into a
    StepRecord."""

    def __init__(
        self,
        sink: Sink,
        *,
        policy: Policy,
        prepare: Callable[[Any], StepRecord] = _identity,
        lighten: Callable[[Any], tuple[Any, int]] = lighten_record,
        heartbeat_seconds: float | None = None,
        on_written: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.sink = sink
        self.policy = policy
        self.prepare = prepare
        self.lighten = lighten  # BufferAndDrop: a step handed over, without its rollouts
        self.heartbeat_seconds = heartbeat_seconds
        self.backlog = Backlog(policy, sink.forget)
        self._wake = threading.Condition()
        self._delivery = Delivery(sink, policy, self.backlog, self._wake, fail=self._fail)
        self._delivery.on_written = on_written
        self._closing = False
        self._final: tuple[RunStatus, str | None] | None = None  # the run's end (for_script)
        self._deadline: float | None = None
        self._gave_up: str | None = None  # BufferAndDrop: a permanent error; recording stops
        self._error: BaseException | None = None  # WaitThenFail: raised on the training thread
        self._done = False
        self._hurry = 0  # flush() calls waiting: the inbox is taken at once
        self._lost_at_close = 0  # steps still waiting when close's timeout ran out (dropped)
        self._thread = threading.Thread(
            target=self._loop, name=f"rollout-lens-writer-{sink.run_id or 'new'}", daemon=True
        )
        self._thread.start()

    @classmethod
    def for_script(
        cls,
        *,
        database_url: str,
        spec: RunSpec,
        prepare: Callable[[Any], StepRecord],
        lighten: Callable[[Any], tuple[Any, int]] = lighten_record,
        max_bytes: int = 256 * 2**20,
        heartbeat_seconds: float = 5.0,
        price_per_device_hour: float = 0.0,
        busy_timeout_ms: int = 30_000,
        resume: tuple[str, int] | None = None,
        process: bool = False,
        reader: StepReader | None = None,
    ) -> StepWriter:
        """A user's script: creates the run (or continues it: `resume`, the key the run was
        created under and the checkpoint's step), buffers and drops rather than stop training.
        With `process`, the database is written from a process of its own (sink_process.py),
        where `reader` reads the judged steps `prepare` makes."""
        from rollout_lens.trainer.recorder.sink_process import script_sink

        url, price, wait = database_url, price_per_device_hour, busy_timeout_ms
        sink = script_sink(
            url, spec, process=process, price=price, wait_ms=wait, resume=resume, reader=reader
        )
        policy, beats = BufferAndDrop(max_bytes=max_bytes), heartbeat_seconds
        return cls(sink, policy=policy, prepare=prepare, lighten=lighten, heartbeat_seconds=beats)

    @classmethod
    def for_launched(
        cls,
        factory: sessionmaker[Session],
        *,
        run_id: int,
        control_tokens: list[str],
        price_per_device_hour: float,
        on_written: Callable[[StepRecord], None] | None = None,
        max_pending: int = 64,
        give_up_after: float = 60.0,
        process: bool = True,
        busy_timeout_ms: int = 30_000,
    ) -> StepWriter:
        """A launched run (the worker's): waits for the database, then fails the run; written
        from a process of its own unless `process` is False (sink_process.py; SQLite's busy
        timeout there `busy_timeout_ms`, as the worker's engine has it)."""
        from rollout_lens.trainer.recorder.sink_process import launched_sink

        price, wait = price_per_device_hour, busy_timeout_ms
        sink = launched_sink(factory, run_id, control_tokens, price, process=process, wait_ms=wait)
        policy = WaitThenFail(give_up_after=give_up_after, max_pending=max_pending)
        return cls(sink, policy=policy, on_written=on_written)

    @property
    def run_id(self) -> int | None:
        return self.sink.run_id

    @property
    def give_up_after(self) -> float:
        return self.policy.give_up_after if isinstance(self.policy, WaitThenFail) else 0.0

    @property
    def dropped_steps(self) -> int:
        return self.backlog.dropped_steps

    @property
    def dropped_rollouts(self) -> int:
        return self.backlog.dropped_rollouts

    @property
    def written_steps(self) -> int:
        return self._delivery.written_steps

    @property
    def busy_answers(self) -> int:
        """Retry-After answers: the store asked to wait."""
        return self._delivery.busy_answers

    @property
    def stop_requested(self) -> bool:
        """Whether the run was cancelled from the dashboard: training should stop (the callback
        stops it the way TRL stops, and ends the run `cancelled`)."""
        ended = self._delivery.ended
        return ended is not None and ended.status == RunStatus.cancelled

    # -- the training thread's side ----------------------------------------------------------------

    def put(self, raw: Any) -> None:
        """Hand a step over. BufferAndDrop: never blocks, never raises. WaitThenFail: prepared
        here, blocks while `max_pending` steps wait, raises the writer's error."""
        if not isinstance(self.policy, WaitThenFail):
            with self._wake:
                if self._delivery.ended is None:  # once the run has ended, nothing more is recorded
                    self.backlog.arrive(raw, self.lighten)
                    if self.backlog.due():  # else taken at the writer's next round
                        self._wake.notify_all()
            return
        self._raise_if_failed()
        record = self.prepare(raw)
        with self._wake:
            while len(self.backlog) >= self.policy.max_pending and self._error is None:
                self._wake.wait()
            self._raise_if_failed()
            self.backlog.add(Pending(record, 0))
            if len(self.backlog.pending) == 1 or self.backlog.writes_now(False):
                self._wake.notify_all()  # the writer times its round from the first step waiting

    def flush(self) -> None:
        """Wait until every step handed over is written (a checkpoint must not outrun its
        records); WaitThenFail raises the writer's error."""
        with self._wake:
            self._hurry += 1  # the steps waiting are taken now, not at the next round
            self._wake.notify_all()
            while self.backlog and not self._stopped():
                self._wake.wait(timeout=0.5)
            self._hurry -= 1
        self._raise_if_failed()

    def close(
        self,
        *,
        status: RunStatus = RunStatus.completed,
        error: str | None = None,
        timeout: float = 60.0,
    ) -> bool:
        """Write what is waiting and stop the thread; True when everything was written.

        BufferAndDrop waits at most `timeout` for the store (a request sent while closing waits
        at most until then), then marks the run finished with `status`; steps still waiting then
        are dropped and counted on the run, and the run's end is tried once more within the
        sink's `final_seconds`. WaitThenFail writes everything (retrying within its policy) and
        raises the writer's error; the worker marks the run finished."""
        with self._wake:
            if not self._closing:
                self._closing = True
                self._final = (status, error)
                self._deadline = time.monotonic() + timeout
                self.sink.deadline = None if self._delivery.waits else self._deadline
                # try once more now
                self._delivery.retry_at = min(self._delivery.retry_at, time.monotonic())
                self._wake.notify_all()
        self._thread.join(None if self._delivery.waits else timeout + self.sink.final_seconds + 5.0)
        left = len(self.backlog) + self._lost_at_close
        if left and not self._delivery.waits:
            _say_lost(left)
        self._raise_if_failed()
        return left == 0

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error

    def _stopped(self) -> bool:
        stopped = self._error is not None or self._gave_up is not None
        return self._done or stopped or self._delivery.ended is not None

    # -- the writer thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._steps()
        except BaseException as exc:  # noqa: BLE001 - e.g. on_written raising: said, not lost
            self._fail(exc)
        finally:
            self.sink.close()
            with self._wake:
                self._done = True
                self._wake.notify_all()

    def _steps(self) -> None:
        last_beat = 0.0
        self._delivery.begin()
        while True:
            with self._wake:
                while not self._due(last_beat):
                    self._wake.wait(timeout=self._wait_seconds(last_beat))
                inbound = self.backlog.round()
                closing = self._closing
            for arrival in inbound:
                self._take(arrival)
            if self._stopped():
                break
            if time.monotonic() >= self._delivery.retry_at and self._delivery.flush():
                if closing and not self.backlog.inbox:
                    self._finish(late=False)
                    break
                if (
                    self.heartbeat_seconds is not None
                    and time.monotonic() - last_beat >= self.heartbeat_seconds
                ):
                    self._delivery.heartbeat()
                    last_beat = time.monotonic()
            if self._stopped():
                break
            if closing and not self._delivery.waits and time.monotonic() >= (self._deadline or 0.0):
                self._out_of_time()
                break

    def _out_of_time(self) -> None:
        """Close's timeout ran out: the steps waiting are dropped, the run's end tried once more."""
        with self._wake:
            self._lost_at_close = self.backlog.drop_all()
            self._wake.notify_all()
        self._finish(late=True)

    def _due(self, last_beat: float) -> bool:
        """Whether the writer's thread has work (steps to take or write, the end, a beat)."""
        if self.backlog.taking(self._closing or self._hurry > 0):
            return True
        now, delivery = time.monotonic(), self._delivery
        if (self._closing or self.backlog.writes_now(self._hurry > 0)) and now >= delivery.retry_at:
            return True
        if self._closing and not delivery.waits and now >= (self._deadline or 0.0):
            return True
        beats = self.heartbeat_seconds is not None and self.run_id is not None
        return beats and now - last_beat >= (self.heartbeat_seconds or 0.0)

    def _wait_seconds(self, last_beat: float) -> float:
        now = time.monotonic()
        waits = [self.backlog.next_round()]
        if self.heartbeat_seconds is not None:
            waits.append(self.heartbeat_seconds - (now - last_beat))
        if self._closing or self.backlog.writes_now(self._hurry > 0):
            waits.append(self._delivery.retry_at - now)
        if self._closing and self._deadline is not None and not self._delivery.waits:
            waits.append(self._deadline - now)
        return max(0.05, min(waits))

    def _finish(self, *, late: bool) -> None:
        """The run's end, where the sink marks it (a script's run: the worker marks launched
        runs); `late`: after close's timeout ran out."""
        if self._final is not None and self.run_id is not None:
            self.sink.finish(*self._final, self.backlog.drops(), late=late)

    def _take(self, arrival: Arrival) -> None:
        """BufferAndDrop: prepare the inbox's first step and keep it in budget."""
        raw = arrival.raw
        pending = self.backlog.prepared(raw, self.prepare)
        with self._wake:
            self.backlog.take(arrival, raw, pending)
            self._wake.notify_all()

    def _fail(self, exc: BaseException) -> None:
        """A permanent error: a launched run fails; a script's recording stops, training goes on."""
        if self._delivery.waits:
            if not isinstance(exc, DatabaseAway):
                wrapped = RuntimeError(f"{self._delivery.what()} failed: {short(exc)}")
                wrapped.__cause__ = exc
                exc = wrapped
            with self._wake:
                self._error = exc
                self._wake.notify_all()
            return
        self._gave_up = short(exc)
        with self._wake:
            self.backlog.drop_all()
            self._wake.notify_all()
        log.error("Rollout Lens: recording stopped, training goes on: %s", self._gave_up)


def _say_lost(left: int) -> None:
    log.warning(
        "Rollout Lens: %d recorded step(s) could not be written before the end of training "
        "(database unreachable); they are lost",
        left,
    )


def _say_ended(exc: RunEnded) -> None:
    if exc.status == RunStatus.cancelled:
        who = dashboard_caller(exc.ended_by)
        log.warning(
            "Rollout Lens: the dashboard cancelled run %s%s: training stops",
            exc.run_id,
            f" (by {who})" if who else "",
        )
    else:
        log.warning(
            "Rollout Lens: run %s ended as %s%s: recording stops, training goes on",
            exc.run_id,
            exc.status,
            f" (by {exc.ended_by})" if exc.ended_by else "",
        )


# -- waiting out a database that is away, outside the step stream ---------------------------------


def is_transient(exc: DBAPIError) -> bool:
    """Connection trouble (retry) rather than a statement the database refuses (give up)."""
    return bool(exc.connection_invalidated) or isinstance(exc, OperationalError)


def gave_up(what: str, waited: float, attempts: int, exc: BaseException) -> DatabaseAway:
    """The error (logged once) of a database that stayed away longer than the caller waits."""
    log.error("Rollout Lens: %s failed after %.0f s: %s", what, waited, short(exc))
    away = DatabaseAway(
        f"{what} failed: the database could not be written for {waited:.0f} s "
        f"({attempts} attempts): {short(exc)}"
    )
    away.__cause__ = exc
    return away


def with_retries(
    action: Callable[[bool], T],
    *,
    what: str,
    give_up_after: float,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`action(retried)` until it succeeds; transient database errors are retried with the
    writer's backoff for at most `give_up_after` seconds, then DatabaseAway is raised. `retried`
    tells the action that an earlier attempt may have committed without its answer arriving."""
    backoff = Backoff(give_up_after=give_up_after)

    def said(exc: Exception, backoff: Backoff) -> None:
        if backoff.attempts == 1:
            log.warning(
                "Rollout Lens: the database failed while %s (%s); retrying for up to %.0f s",
                what,
                short(exc),
                give_up_after,
            )

    try:
        result = retry(
            lambda: action(backoff.attempts > 0),
            backoff=backoff,
            retryable=lambda exc: isinstance(exc, DBAPIError) and is_transient(exc),
            sleep=sleep,
            on_failure=said,
        )
    except DBAPIError as exc:
        if backoff.down_since is None or not is_transient(exc):
            raise
        raise gave_up(what, backoff.waited(), backoff.attempts, exc) from exc
    down = backoff.succeeded()
    if down is not None:
        log.warning("Rollout Lens: the database is back after %.0f s; %s done", down, what)
    return result


def mark_finished(
    factory: sessionmaker[Session], run_id: int, give_up_after: float, **columns: Any
) -> None:
    """store.mark_finished(status=..., error=...), waiting out a database that is away; if it
    stays away (DatabaseAway) the heartbeats have stopped too and the dashboard marks the run
    lost."""

    def finish(_retried: bool) -> None:
        with session_scope(factory) as session:
            store.mark_finished(session, run_id=run_id, **columns)

    with_retries(
        finish,
        what=f"marking run {run_id} {columns['status']}",
        give_up_after=max(give_up_after, FINISH_GIVE_UP_SECONDS),
    )


def short(exc: BaseException) -> str:
    """The first line of the driver's message (not SQLAlchemy's statement dump)."""
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
