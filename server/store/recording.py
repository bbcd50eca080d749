"""The write path: a run's steps, their rollouts and series, its summary columns, rollups and
alerts — what a trainer writes every step, so it is built for speed.

A Recorder holds what the run's next write needs (series layout, rollup progress, the last 25
steps' means, the alert rules' windows, interned prompt and facts ids, token ids already known)
and writes one step in a handful of cached Core statements. Only one recorder writes a run at a
time (the worker training it, the callback's writer, an import). If a write's transaction rolls
back, throw the recorder away and load a new one: its memory is ahead of the database.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from rollout_lens.server import alerts as rules
from rollout_lens.server.models import (
    ROLLUP_WIDTHS,
    AlertRow,
    Facts,
    Prompt,
    Rollout,
    Run,
    RunToken,
    Step,
    utcnow,
)
from rollout_lens.server.packing import pack_half_matrix, pack_halves, pack_ints
from rollout_lens.server.records import RolloutRecord, StepRecord
from rollout_lens.server.series import STEP_SERIES, WINDOW
from rollout_lens.server.store import layout, rollups
from rollout_lens.server.store.sql import finite, greatest, upsert_insert
from sqlalchemy import Connection, insert, select, update
from sqlalchemy.orm import Session

STEPS, ROLLOUTS, ALERTS = Step.__table__, Rollout.__table__, AlertRow.__table__
TOKEN_ARRAYS = {"completion_ids": None, "token_logprobs": None, "control_probs": None}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


class Recorder:
    """Writes the steps of one run (see the module docstring)."""

    def __init__(self, conn: Connection, *, run_id: int, control_tokens: Sequence[str]) -> None:
        self.run_id = run_id
        self.control_tokens = list(control_tokens)
        run = conn.execute(
            select(Run.series_names, Run.keep_tokens_every).where(Run.id == run_id)
        ).one()
        self.series_names: list[str] = list(run.series_names or [])
        self.keep_every: int | None = run.keep_tokens_every or None
        self.rolled = rollups.rolled_through(conn, run_id=run_id)
        history = conn.execute(
            select(Step.step, *layout.STEP_COLUMNS, Step.series)
            .where(Step.run_id == run_id)
            .order_by(Step.step.desc())
            .limit(rules.CONTEXT)
        ).all()[::-1]
        names = layout.all_names(self.series_names)
        self.recent: deque[tuple[float | None, float | None]] = deque(maxlen=WINDOW)
        self.watch = rules.Watch()
        for row in history:
            values = dict(zip(names, layout.row_values(row, len(self.series_names)), strict=True))
            self.recent.append((values["true_accuracy"], values["reward_mean"]))
            self.watch.feed(row[0], values)
        self.first_step: int | None = conn.scalar(
            select(Step.step).where(Step.run_id == run_id).order_by(Step.step).limit(1)
        )
        # Retention: the newest rollouts are kept until the next arrive; then dropped unless a
        # reason to keep them was found (every N steps, the first step, an alert).
        self.newest: tuple[int, bool] | None = None
        if history:
            newest = conn.execute(
                select(Step.step, Step.rollout_step)
                .where(Step.run_id == run_id)
                .order_by(Step.step.desc())
                .limit(1)
            ).one()
            fired = conn.scalar(
                select(AlertRow.id).where(AlertRow.run_id == run_id, AlertRow.step == newest[0])
            )
            self.newest = (newest[1], self._keeps(newest[1], fired is not None))
        self.tokens_seen = set(
            conn.scalars(select(RunToken.token_id).where(RunToken.run_id == run_id))
        )
        self.prompt_ids: dict[str, int] = {}
        self.facts_ids: dict[str, int] = {}

    # -- a step --------------------------------------------------------------------------------

    def write(
        self,
        conn: Connection,
        record: StepRecord,
        *,
        recorded_at: datetime | None = None,
        device_seconds: float = 0.0,
        price_per_hour: float = 0.0,
    ) -> list[rules.Alert]:
        """Write one step (inside the caller's transaction); return the alerts it fired."""
        step = record.step
        values = {name: finite(record.values.get(name)) for name in STEP_SERIES}
        metrics = {name: finite(value) for name, value in record.metrics.items()}
        new_names = [n for n in metrics if n not in self.series_names]
        self.series_names += new_names
        self._roll_finished_buckets(conn, step)

        fired = self.watch.push(step, values | {n: v for n, v in metrics.items() if v is not None})
        if record.rollouts:
            self._retire_newest(conn, record.rollout_step)
        if self.first_step is None or step < self.first_step:
            self.first_step = step
        keep = self._keeps(record.rollout_step, bool(fired))
        if self.newest is None or self.newest[0] != record.rollout_step:
            self.newest = (record.rollout_step, keep)
        else:
            self.newest = (self.newest[0], self.newest[1] or keep)

        conn.execute(
            insert(STEPS),
            {
                **values,
                "run_id": self.run_id,
                "step": step,
                "rollout_step": record.rollout_step,
                "series": layout.encode(metrics, self.series_names),
                "tokens_kept": True,
                "recorded_at": recorded_at or utcnow(),
            },
        )
        self.add_rollouts(conn, step=record.rollout_step, rollouts=record.rollouts)
        if fired:
            conn.execute(
                insert(ALERTS),
                [
                    {
                        "run_id": self.run_id,
                        "step": a.step,
                        "kind": a.kind,
                        "series": a.series,
                        "message": a.message,
                    }
                    for a in fired
                ],
            )
        self.recent.append((values["true_accuracy"], values["reward_mean"]))
        summary: dict[str, Any] = {
            "current_step": greatest(conn)(Run.current_step, step),
            "recent_true_accuracy": _mean(a for a, _ in self.recent),
            "recent_reward": _mean(r for _, r in self.recent),
            "heartbeat_at": utcnow(),
            "alerts_through": greatest(conn)(Run.alerts_through, step),
        }
        if device_seconds:
            summary["device_seconds"] = Run.device_seconds + device_seconds
            summary["cost"] = Run.cost + device_seconds / 3600.0 * price_per_hour
        if new_names:
            summary["series_names"] = list(self.series_names)
        conn.execute(update(Run).where(Run.id == self.run_id).values(**summary))
        return fired

    def _keeps(self, step: int, fired: bool) -> bool:
        """Whether retention keeps the token arrays of the rollouts generated at `step`."""
        every = self.keep_every
        return every is None or fired or step % every == 0 or step == self.first_step

    def _retire_newest(self, conn: Connection, rollout_step: int) -> None:
        """New rollouts arrived: drop the previous newest ones' token arrays unless kept."""
        if self.newest is None or self.newest[0] == rollout_step or self.newest[1]:
            return
        old = self.newest[0]
        conn.execute(
            update(ROLLOUTS)
            .where(ROLLOUTS.c.run_id == self.run_id, ROLLOUTS.c.step == old)
            .values(**TOKEN_ARRAYS)
        )
        conn.execute(
            update(STEPS)
            .where(STEPS.c.run_id == self.run_id, STEPS.c.rollout_step == old)
            .values(tokens_kept=False)
        )

    def _roll_finished_buckets(self, conn: Connection, step: int) -> None:
        for width in ROLLUP_WIDTHS:
            finished = (step - 1) // width - 1  # every bucket before this step's
            if finished > self.rolled[width]:
                rollups.roll(
                    conn,
                    run_id=self.run_id,
                    width=width,
                    first=self.rolled[width] + 1,
                    last=finished,
                    n_series=len(self.series_names),
                )
                self.rolled[width] = finished

    # -- rollouts ------------------------------------------------------------------------------

    def add_rollouts(
        self, conn: Connection, *, step: int, rollouts: Sequence[RolloutRecord]
    ) -> None:
        """Write rollouts generated at `step` (write calls it; an import may call it alone)."""
        if not rollouts:
            return
        prompt_ids = self._intern(
            conn, Prompt, "text", self.prompt_ids, (r.prompt for r in rollouts)
        )
        facts, own = _split_meta(rollouts)
        facts_ids = self._intern(conn, Facts, "data", self.facts_ids, facts, dump=True)
        self._add_tokens(conn, rollouts)
        ctrl = self.control_tokens
        conn.execute(
            insert(ROLLOUTS),
            [
                {
                    "run_id": self.run_id,
                    "step": step,
                    "group": r.group,
                    "idx": r.index,
                    "prompt_id": prompt_ids[_sha(r.prompt)],
                    "target": r.target,
                    "completion": r.completion,
                    "vote": r.vote,
                    "verifier_reward": float(r.verifier_reward),
                    "true_score": finite(r.true_score),
                    "advantage": float(r.advantage),
                    "sum_logprob": r.sum_logprob,
                    "format_valid": bool(r.format_valid),
                    "format_state": r.format_state,
                    "completion_ids": pack_ints(r.completion_ids),
                    "token_logprobs": pack_halves(r.token_logprobs),
                    "control_probs": pack_half_matrix(
                        [r.control_probs.get(t) or [0.0] * len(r.completion_ids) for t in ctrl]
                    ),
                    "facts_id": facts_ids[_sha(_dumps(f))] if f else None,
                    "own_meta": o or None,
                }
                for r, f, o in zip(rollouts, facts, own, strict=True)
            ],
        )

    def _intern(
        self,
        conn: Connection,
        model: Any,
        column: str,
        cache: dict[str, int],
        items: Iterable[Any],
        *,
        dump: bool = False,
    ) -> dict[str, int]:
        """Store each distinct prompt text (or facts dict) once; return sha256 → id."""
        wanted = {}
        for item in items:
            if dump and not item:
                continue
            wanted[_sha(_dumps(item) if dump else item)] = item
        missing = {h: v for h, v in wanted.items() if h not in cache}
        if missing:
            conn.execute(
                upsert_insert(conn, model)
                .values([{"sha256": h, column: v} for h, v in missing.items()])
                .on_conflict_do_nothing(index_elements=["sha256"])
            )
            rows = conn.execute(select(model.sha256, model.id).where(model.sha256.in_(missing)))
            cache.update({digest: row_id for digest, row_id in rows})
        return cache

    def _add_tokens(self, conn: Connection, rollouts: Sequence[RolloutRecord]) -> None:
        new: dict[int, str] = {}
        for r in rollouts:
            texts = r.tokens if r.tokens is not None else r.meta.get("tokens")
            if not texts or len(texts) != len(r.completion_ids):
                continue
            for token_id, text in zip(r.completion_ids, texts, strict=True):
                if token_id not in self.tokens_seen and token_id not in new:
                    new[token_id] = str(text)
        if new:
            conn.execute(
                upsert_insert(conn, RunToken).on_conflict_do_nothing(
                    index_elements=["run_id", "token_id"]
                ),
                [{"run_id": self.run_id, "token_id": i, "text": t} for i, t in new.items()],
            )
            self.tokens_seen.update(new)


def _split_meta(
    rollouts: Sequence[RolloutRecord],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each rollout's meta → (facts its whole group shares, its own keys); token texts are kept
    apart (run_tokens), not in meta."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        groups.setdefault(r.group, []).append(i)
    facts: list[dict[str, Any]] = [{} for _ in rollouts]
    own: list[dict[str, Any]] = [{} for _ in rollouts]
    for members in groups.values():
        metas = [{k: v for k, v in rollouts[i].meta.items() if k != "tokens"} for i in members]
        keys = set().union(*metas)
        shared = {
            k
            for k in keys
            if all(k in m for m in metas) and len({_dumps(m[k]) for m in metas}) == 1
        }
        for i, meta in zip(members, metas, strict=True):
            facts[i] = {k: v for k, v in meta.items() if k in shared}
            own[i] = {k: v for k, v in meta.items() if k not in shared}
    return facts, own


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


# --- the session-level entry points the rest of the code calls -----------------------------------


def _refresh_run(session: Session, run_id: int) -> None:
    """Core writes bypass the session: bring a Run it holds up to date."""
    for obj in list(session.identity_map.values()):
        if isinstance(obj, Run) and obj.id == run_id:
            session.refresh(obj)


def record_step(
    session: Session,
    *,
    run_id: int,
    record: StepRecord,
    control_tokens: Sequence[str],
    recorded_at: datetime | None = None,
    recorder: Recorder | None = None,
) -> Recorder:
    """Write one step in the session's transaction; returns the recorder, which a caller that
    writes many steps of the run passes back in (it saves reloading the run's state)."""
    conn = session.connection()
    recorder = recorder or Recorder(conn, run_id=run_id, control_tokens=control_tokens)
    recorder.write(conn, record, recorded_at=recorded_at)
    _refresh_run(session, run_id)
    return recorder


def add_rollouts(
    session: Session,
    *,
    run_id: int,
    step: int,
    rollouts: Sequence[RolloutRecord],
    control_tokens: Sequence[str],
) -> None:
    """Write rollouts generated at `step` alone (an import of rollouts without steps)."""
    conn = session.connection()
    Recorder(conn, run_id=run_id, control_tokens=control_tokens).add_rollouts(
        conn, step=step, rollouts=rollouts
    )
