"""The page bench's data: a long run and a short one, a set of long runs to compare, and many
short runs in every state for the runs page; all written through server.store (the trainer's
write path), filled once into an SQLite file that later runs reuse, and copied row for row into
PostgreSQL when the bench measures that too.

Filling goes through store.create_run / Recorder / record_step / add_device_time / mark_finished
only, so it follows whatever those write. The cache file is named by FILL_VERSION, the schema's Alembic head
and the sizes: a new migration or a new fill is a new file.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout_lens.server import store
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import head_revision, upgrade
from rollout_lens.server.store.models import Base, RunStatus
from sqlalchemy import Engine, Integer, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from bench.synthetic import CONTROL_TOKENS, SyntheticRun

FILL_VERSION = 1  # bump when what build() writes changes
EVAL_EVERY = 50  # the compared runs evaluate every this many steps (the compare page shows it)


@dataclass(frozen=True)
class Sizes:
    steps: int  # the long run's steps, and each compared run's
    small: int  # the short run the long one is measured against
    compared: int  # runs on the compare page: the long run and compared - 1 more like it
    runs: int  # runs in all: the runs page lists this many
    patched: int = 20  # 30-step runs beside the long ones (what the bench always had)

    @property
    def key(self) -> str:
        return f"{self.steps}x{self.compared}-{self.small}-{self.patched}-{self.runs}runs"


FULL = Sizes(steps=10_000, small=100, compared=10, runs=1_000)
QUICK = Sizes(steps=60, small=30, compared=10, runs=200, patched=2)


@dataclass(frozen=True)
class Dataset:
    big: int  # the long run (with rollouts at every step)
    little: int  # the short run
    compared: list[int]  # the runs the compare page shows, the long run first
    runs: int  # runs in all


def fill(
    factory: sessionmaker[Session],
    *,
    steps: int,
    variant: str,
    seed: int,
    name: str,
    status: RunStatus = RunStatus.completed,
    batch: int = 100,
    eval_every: int = 0,
    rollouts_every: int = 1,
    progress: Callable[[int], None] | None = None,
) -> int:
    """A synthetic run written through store.Recorder (the trainer's write path), one
    transaction per `batch` steps.

    With `rollouts_every` > 1 only every that many steps (and the last 5) keep their rollouts:
    a long run to overlay on charts, whose rollouts no measured page reads but at its end.
    """
    with session_scope(factory) as session:
        run = store.create_run(
            session,
            name=name,
            model="tiny",
            total_steps=steps,
            group_size=8,
            seed=seed,
            variant=variant,
            k=4 if variant == "patched" else None,
            config={
                "variant": variant,
                "steps": steps,
                "learning_rate": 3e-4,
                "k": 4,
                "seed": seed,
                "temperature": 1.0,
            },
            control_tokens=CONTROL_TOKENS,
            status=RunStatus.running,
        )
        run_id = run.id
    synthetic = SyntheticRun(variant=variant, seed=seed)
    recorder: store.Recorder | None = None
    for start in range(1, steps + 1, batch):
        with factory.kw["bind"].begin() as conn:
            if recorder is None:
                recorder = store.Recorder(conn, run_id=run_id, control_tokens=CONTROL_TOKENS)
            for step in range(start, min(start + batch, steps + 1)):
                keep = step % rollouts_every == 0 or step > steps - 5
                record = synthetic.step(step, eval_every=eval_every, with_rollouts=keep)
                seconds = record.values["wall_time"] or 0
                recorder.write(conn, record, device_seconds=seconds, price_per_hour=2.0)
        if progress:
            progress(min(start + batch - 1, steps))
    if status != RunStatus.running:
        with session_scope(factory) as session:
            store.mark_finished(session, run_id=run_id, status=status)
    return run_id


# The runs page's crowd: what a team's sweeps leave behind, mostly finished.
SWEEP_STATES = (
    [RunStatus.completed] * 80
    + [RunStatus.failed] * 6
    + [RunStatus.cancelled] * 5
    + [RunStatus.lost] * 3
    + [RunStatus.queued] * 4
    + [RunStatus.running] * 2
)
SWEEP_MODELS = ("tiny", "Qwen/Qwen3-0.6B", "HuggingFaceTB/SmolLM2-135M-Instruct")


def fill_sweep(factory: sessionmaker[Session], *, count: int, seed: int = 0) -> None:
    """`count` short runs (0–2 recorded steps each, no rollouts) in every state."""
    rng = random.Random(seed)
    for start in range(0, count, 50):
        with session_scope(factory) as session:
            for i in range(start, min(start + 50, count)):
                variant = rng.choice(("leaky", "patched"))
                lr = rng.choice((1e-4, 3e-4, 1e-3))
                status = rng.choice(SWEEP_STATES)
                run_id = store.create_run(
                    session,
                    name=f"sweep {i} {variant} lr={lr:g}",
                    model=rng.choice(SWEEP_MODELS),
                    total_steps=rng.choice((100, 150, 300)),
                    group_size=rng.choice((4, 8)),
                    seed=i,
                    variant=variant,
                    k=4 if variant == "patched" else None,
                    config={"variant": variant, "learning_rate": lr, "seed": i},
                    control_tokens=CONTROL_TOKENS,
                    status=RunStatus.running if status != RunStatus.queued else status,
                ).id
                if status == RunStatus.queued:
                    continue
                synthetic = SyntheticRun(variant=variant, seed=i)
                recorder = None
                for step in range(1, rng.randint(1, 2) + 1):
                    record = synthetic.step(step, with_rollouts=False)
                    recorder = store.record_step(
                        session,
                        run_id=run_id,
                        record=record,
                        control_tokens=CONTROL_TOKENS,
                        recorder=recorder,
                    )
                store.add_device_time(
                    session, run_id=run_id, seconds=rng.uniform(10, 5000), price_per_hour=2.0
                )
                if status != RunStatus.running:
                    store.mark_finished(session, run_id=run_id, status=status)


def build(url: str, sizes: Sizes, *, say: Callable[[str], None] = print) -> None:
    """Migrate the database at `url` and write every run of the bench into it."""
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    started = time.perf_counter()

    def progress(name: str) -> Callable[[int], None] | None:
        if not sys.stdout.isatty():
            return None
        return lambda s: say(f"\r  {name}: {s}/{sizes.steps} steps ")

    fill(
        factory,
        steps=sizes.steps,
        variant="leaky",
        seed=1,
        name=f"leaky {sizes.steps}",
        eval_every=EVAL_EVERY,
        progress=progress("the long run"),
    )
    fill(factory, steps=sizes.small, variant="leaky", seed=2, name=f"leaky {sizes.small}")
    for i in range(sizes.patched):
        fill(factory, steps=30, variant="patched", seed=10 + i, name=f"patched {i}")
    for i in range(2, sizes.compared + 1):
        fill(
            factory,
            steps=sizes.steps,
            variant="patched" if i % 2 else "leaky",
            seed=100 + i,
            name=f"compare {i}",
            eval_every=EVAL_EVERY,
            rollouts_every=100,
            progress=progress(f"compared run {i}/{sizes.compared}"),
        )
    fill_sweep(factory, count=sizes.runs - 2 - sizes.patched - (sizes.compared - 1))
    engine.dispose()
    say(f"\r  filled through server.store in {time.perf_counter() - started:.0f} s\n")


def find(factory: sessionmaker[Session], sizes: Sizes) -> Dataset:
    """The bench's runs in a filled database, by name."""
    with session_scope(factory) as session:
        runs = store.list_runs(session)
    ids = {run.name: run.id for run in runs}
    compared = [ids[f"leaky {sizes.steps}"]]
    compared += [ids[f"compare {i}"] for i in range(2, sizes.compared + 1)]
    return Dataset(ids[f"leaky {sizes.steps}"], ids[f"leaky {sizes.small}"], compared, len(runs))


def cached(sizes: Sizes, cache_dir: Path, *, say: Callable[[str], None] = print) -> Path:
    """The filled SQLite file for `sizes` under `cache_dir`, built on first use."""
    path = cache_dir / f"pages-v{FILL_VERSION}-{head_revision()}-{sizes.key}.db"
    if path.exists():
        say(f"  reusing {path}\n")
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    say(f"  filling {path} once (later runs reuse it)\n")
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        partial = Path(tmp) / "filling.db"
        build(f"sqlite:///{partial}", sizes, say=say)
        checkpoint = make_engine(f"sqlite:///{partial}")
        with checkpoint.connect() as conn:  # fold the WAL in: one self-contained file
            conn.execute(text("PRAGMA wal_checkpoint(TRUNCATE)"))
        checkpoint.dispose()
        shutil.move(partial, path)
    return path


def copy_database(source: Engine, target: Engine, *, chunk: int = 5000) -> int:
    """Copy every row of the models' tables from `source` into the migrated, empty `target`
    (parents first), then move PostgreSQL's id sequences past the copied ids; returns the rows
    copied. It reads the tables the models define, so it follows the schema as it changes."""
    copied = 0
    with source.connect() as src, target.begin() as dst:
        for table in Base.metadata.sorted_tables:
            result = src.execution_options(yield_per=chunk).execute(select(table))
            for rows in result.partitions(chunk):
                dst.execute(table.insert(), [dict(row._mapping) for row in rows])
                copied += len(rows)
        if target.dialect.name == "postgresql":
            for table in Base.metadata.sorted_tables:
                keys = list(table.primary_key.columns)
                if len(keys) == 1 and isinstance(keys[0].type, Integer):
                    column = keys[0].name
                    sequence = func.pg_get_serial_sequence(table.name, column)
                    top = select(func.coalesce(func.max(table.c[column]), 0) + 1).scalar_subquery()
                    dst.execute(select(func.setval(sequence, top, False)))
            dst.execute(text("ANALYZE"))
    return copied
