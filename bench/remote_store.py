"""bench/remote.py's reading back: what the dashboard's database holds of the trainers' runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_lens.server.store.db import make_engine
from sqlalchemy import Engine, text


def recorded_steps(engine: Engine) -> int:
    """Steps recorded so far by the bench's trainers (the baseline run not counted)."""
    with engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT count(*) FROM steps s JOIN runs r ON r.id = s.run_id "
                "WHERE r.name LIKE 'bench trainer %'"
            )
        ).scalar()
    return int(found or 0)


def read_back(db: str, run_ids: list[int], steps: int, per_step: int) -> dict[str, Any]:
    """Every run read back: its steps (1..`steps` once each) and each step's rollouts, and the
    drops the runs were told of."""
    engine = make_engine(db)
    recorded = rollouts = doubled = lost_steps = 0
    runs_dropped = [0, 0]
    with engine.connect() as conn:
        for run_id in run_ids:
            found = list(
                conn.execute(
                    text("SELECT step FROM steps WHERE run_id = :r ORDER BY step"), {"r": run_id}
                ).scalars()
            )
            recorded += len(found)
            lost_steps += len(set(range(1, steps + 1)) - set(found))
            doubled += len(found) - len(set(found))
            counts = conn.execute(
                text("SELECT step, count(*) FROM rollouts WHERE run_id = :r GROUP BY step"),
                {"r": run_id},
            ).all()
            for _, n in counts:
                rollouts += n
                doubled += max(0, n - per_step)
            row = conn.execute(
                text("SELECT dropped_steps, dropped_rollouts FROM runs WHERE id = :r"),
                {"r": run_id},
            ).one()
            runs_dropped = [runs_dropped[0] + row[0], runs_dropped[1] + row[1]]
    engine.dispose()
    return {
        "recorded_steps": recorded,
        "recorded_rollouts": rollouts,
        "doubled": doubled,
        "lost_steps": lost_steps,
        "lost_rollouts": len(run_ids) * steps * per_step - rollouts,
        "runs_dropped": runs_dropped,
    }


def database_bytes(db: str) -> int:
    """The whole database's bytes: PostgreSQL's tables with TOAST and indexes, or the file."""
    if db.startswith("sqlite"):
        return Path(db.removeprefix("sqlite:///")).stat().st_size
    engine = make_engine(db)
    with engine.connect() as conn:
        total = conn.execute(
            text(
                "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r'"
            )
        ).scalar()
    engine.dispose()
    return int(total or 0)


def store_bytes(db: str, run_id: int, step: int) -> int:
    """Bytes of the step's rollouts' arrays and texts in rollout_data (the store's codec)."""
    engine = make_engine(db)
    length = "length" if db.startswith("sqlite") else "octet_length"
    columns = " + ".join(f"coalesce({length}(d.{c}), 0)" for c in ("ids", "logprobs", "control"))
    with engine.connect() as conn:
        total = conn.execute(
            text(
                f"SELECT sum({columns} + coalesce({length}(d.text), 0)) FROM rollout_data d "
                "JOIN rollouts r ON r.id = d.rollout_id WHERE r.run_id = :r AND r.step = :s"
            ),
            {"r": run_id, "s": step},
        ).scalar()
    engine.dispose()
    return int(total or 0)
