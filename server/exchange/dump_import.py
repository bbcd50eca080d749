"""A folder of a trainer's per-step dump files → a run: what every dump format provides, and the
one-shot import (`import-trl`, `import-verl` without `--follow`) in ONE transaction.

A format (server/exchange/trl_import.py, server/exchange/verl_import.py) lists its files, reads a step's files
whole (checking them, before anything is written), plans the run from the steps read (group
size, config, notes), and turns a step into a StepRecord. server/exchange/follow.py drives the same
formats while the trainer is still writing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.exchange.dump_files import (
    SETTLE_SECONDS,
    DumpFile,
    Incomplete,
    Settling,
    Unit,
    units,
)
from rollout_lens.server.exchange.dump_rows import SeriesNames
from rollout_lens.server.exchange.importer import NAME_CHARS, Imported
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunSource, RunStatus
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

BUSY_LIMIT = 30.0  # a one-shot import waits this long (beyond settling) for a file being written


@dataclass
class RunPlan:
    """The run a folder becomes."""

    name: str
    model: str
    group_size: int
    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)


class DumpFormat(Protocol):
    """A trainer's dump folder, read step by step."""

    source: RunSource
    folder: Path
    folder_key: str  # the run config key holding the resolved folder (a follower resumes by it)
    empty: str  # the message for a folder without any dump file

    def scan(self) -> list[DumpFile]:
        """Every dump file there now (InvalidInput for a missing folder)."""

    def check(self, unit: Unit) -> Any:
        """Read a step's files whole: what plan() needs of them; Incomplete or InvalidInput."""

    def plan(self, checked: Sequence[Any]) -> RunPlan:
        """The new run, from the steps read so far; fixes the format's choices (group size…)."""

    def adopt(self, run: Any) -> None:
        """Take the choices of an existing run (a follower resuming it); InvalidInput on conflict."""

    def wants_more(self, unit: Unit) -> bool:
        """Whether the newest step expects another file before it is read (unless final)."""

    def record(self, unit: Unit) -> StepRecord:
        """The step as the store takes it (after plan or adopt)."""


def readable(fmt: DumpFormat, found: Sequence[Unit], *, final: bool) -> list[tuple[Unit, Any]]:
    """The steps that read whole, checked, in order: the newest may still be being written (it
    stops the list, unless `final`); an earlier one that does not read whole is an error."""
    out = []
    for unit in found:
        try:
            out.append((unit, fmt.check(unit)))
        except Incomplete:
            if unit.followed or final:
                raise
            break
    return out


class DumpWriter:
    """A dump folder's steps into its run through the one writer (store.RunWriter, the run's
    shape following the steps), each step's series names checked first (SeriesNames: a run
    holds at most MAX_SERIES_PER_RUN; the step that brings one more is refused, not written)."""

    def __init__(
        self, run_id: int, *, prompts_per_step: int = 1, total_steps: int | None = None
    ) -> None:
        self.writer = store.RunWriter(
            run_id, follow_shape=True, prompts_per_step=prompts_per_step, total_steps=total_steps
        )
        self.series: SeriesNames | None = None  # the run's series names (read on first use)

    def write(self, session: Session, records: Iterable[StepRecord]) -> tuple[int, int]:
        """Write the steps in the session's transaction; (steps, rollouts) written. After a
        failed transaction call reset()."""
        return self.writer.write(session, self._checked(session, records))

    def _checked(self, session: Session, records: Iterable[StepRecord]) -> Iterator[StepRecord]:
        for record in records:
            if self.series is None:
                self.series = SeriesNames(store.series_names(session, run_id=self.writer.run_id))
            try:
                self.series.add(record.metrics)
            except InvalidInput as exc:
                raise InvalidInput(f"step {record.step}: {exc}") from None
            yield record

    def reset(self) -> None:
        """Forget the writer's memory: it is ahead of a transaction that rolled back."""
        self.writer.reset()
        self.series = None


def create_run(session: Session, fmt: DumpFormat, plan: RunPlan, status: RunStatus) -> int:
    """Insert the planned run; its id."""
    if len(plan.name) > NAME_CHARS:
        raise InvalidInput(f"--name: at most {NAME_CHARS} characters, got {len(plan.name)}")
    run = store.create_run(
        session,
        name=plan.name,
        model=plan.model,
        total_steps=0,
        group_size=plan.group_size,
        config=plan.config,
        status=status,
        source=fmt.source,
        notes=plan.notes,
    )
    return run.id


def refused(folder: Path, exc: IntegrityError | DataError) -> InvalidInput:
    """A value the database would not store, as bad input."""
    return InvalidInput(f"{folder}: the database refused a value: {exc.orig}")


def import_dumps(
    factory: sessionmaker[Session],
    fmt: DumpFormat,
    *,
    settle: float = SETTLE_SECONDS,
    total_steps: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Imported:
    """Create a completed run of every step in the folder, in one transaction: InvalidInput, and
    nothing created, for a folder without dumps or any file that is not the format's."""
    settling = Settling(settle)
    waited = 0.0
    while True:
        files = fmt.scan()
        if not files:
            raise InvalidInput(fmt.empty)
        found = units(files, after=None, settling=settling, wants_more=lambda u: False, final=True)
        if len(found) == len({f.step for f in files}):
            break
        if waited > settle + BUSY_LIMIT:
            raise InvalidInput(
                f"{files[-1].path}: still being written; import it when the trainer is done with "
                "it, or follow the folder (--follow)"
            )
        sleep(0.1)  # the newest file changed a moment ago: let it settle
        waited += 0.1
    checked = readable(fmt, found, final=True)
    plan = fmt.plan([c for _, c in checked])
    try:
        with session_scope(factory) as session:
            run_id = create_run(session, fmt, plan, RunStatus.completed)
            writer = DumpWriter(run_id, total_steps=total_steps)
            steps, rollouts = writer.write(session, (fmt.record(unit) for unit in found))
    except (IntegrityError, DataError) as exc:
        raise refused(fmt.folder, exc) from exc
    return Imported(run_id, plan.name, steps, rollouts)
