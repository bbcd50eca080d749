"""Per-prompt rollups, written in the step's transaction: a row a group (`prompt_groups`, its
figures) and a row a run's prompt (`run_prompts`, its groups folded in (step, group) order), so
the prompt lens reads rows, never a scan of the rollouts (server.core.prompt_rules says what
each figure means).

The Recorder hands each add_rollouts' groups to its PromptRollup. A group whose rollouts come
in two calls (an import's batches) is figured again from its rollouts; a group that comes
before a prompt's last one (not expected: steps rise) folds that prompt again from its group
rows, as a resume's truncation and the migration's backfill do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from rollout_lens.server.core.prompt_rules import (
    LABEL_CHARS,
    GroupFigures,
    PromptFold,
    group_figures,
    last_user_turn,
)
from rollout_lens.server.store.models import PromptGroupRow, RolloutRow, RunPromptRow
from sqlalchemy import Connection, delete, func, select, update
from sqlalchemy.orm import Session

if TYPE_CHECKING:  # recording imports this module
    from rollout_lens.server.store.recording import BulkInsert

GROUP_COLUMNS = (
    "run_id",
    "step",
    "group",
    "prompt_id",
    "size",
    "reward_mean",
    "reward_min",
    "reward_max",
    "reward_n",
    "true_n",
    "true_mean",
    "correct",
    "solved",
    "zero_spread",
    "agreement",
    "votes",
)
FOLD_COLUMNS = (
    "groups",
    "rollouts",
    "first_step",
    "last_step",
    "last_group",
    "reward_sum",
    "reward_n",
    "true_sum",
    "true_n",
    "solved_groups",
    "solved_at",
    "last_solved",
    "last_failed",
    "state",
    "flips",
    "zero_spread",
)
NAMED_COLUMNS = ("label", "query_key", "user_key", "target")
PROMPT_COLUMNS = ("run_id", "prompt_id", *FOLD_COLUMNS, "votes", *NAMED_COLUMNS)
CHUNK = 500  # ids an IN list holds


@dataclass
class NewGroup:
    """A group as add_rollouts has it: its prompt and its rollouts' values."""

    group: int
    prompt_id: int
    prompt: str
    query: str | None
    target: str | None
    rewards: list[float | None]
    true_scores: list[float | None]
    votes: list[str | None]


@dataclass
class _Named:
    """What tells a run's prompt apart (RunPromptRow's label, keys and target)."""

    label: str
    query_key: str
    user_key: str
    target: str | None


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def named(prompt: str, query: str | None, target: str | None) -> _Named:
    """A new prompt's label (its query, else its last user turn) and match keys."""
    user = last_user_turn(prompt)
    user_key = _sha(user)
    return _Named(
        label=(query or user)[:LABEL_CHARS],
        query_key=_sha(query) if query else user_key,
        user_key=user_key,
        target=target,
    )


def _json(pairs: Iterable[tuple[str | None, int]]) -> str:
    return orjson.dumps([[v, c] for v, c in pairs]).decode()


def stored_votes(value: object) -> list[tuple[str | None, int]]:
    """A votes column as stored ([[vote, count], ...]; SQLite may hand back its text)."""
    if isinstance(value, str | bytes):
        value = orjson.loads(value)
    return [(v, int(c)) for v, c in value] if isinstance(value, list) else []


def _fold_from_row(row: Any) -> PromptFold:
    """A run_prompts row (its FOLD_COLUMNS and votes) as a PromptFold."""
    fold = PromptFold(**{name: getattr(row, name) for name in FOLD_COLUMNS})
    fold.votes = dict(stored_votes(row.votes))
    return fold


def _figures_from_row(row: Any) -> GroupFigures:
    """A prompt_groups row as GroupFigures."""
    names = [c for c in GROUP_COLUMNS if c not in ("run_id", "step", "group", "prompt_id")]
    values = {name: getattr(row, name) for name in names}
    values["votes"] = stored_votes(values["votes"])
    return GroupFigures(**values)


class _Sql:
    """The statements a step writes, as the driver takes them (as the Recorder's)."""

    def __init__(self, conn: Connection) -> None:
        from rollout_lens.server.store.recording import BulkInsert

        self.postgres = conn.dialect.name == "postgresql"
        self.mark = "%s" if self.postgres else "?"
        self.insert_groups = BulkInsert.of("prompt_groups", GROUP_COLUMNS, self.postgres)
        updates = ", ".join(f'"{c}" = excluded."{c}"' for c in PROMPT_COLUMNS[2:])
        self.upsert_prompts = BulkInsert.of(
            "run_prompts",
            PROMPT_COLUMNS,
            self.postgres,
            f" ON CONFLICT (run_id, prompt_id) DO UPDATE SET {updates}",
        )

    def insert(self, conn: Connection, bulk: BulkInsert, rows: list[tuple[object, ...]]) -> None:
        from rollout_lens.server.store.recording import DriverSql

        DriverSql(conn).insert(bulk, rows)


class PromptRollup:
    """A run's per-prompt rollups as its Recorder writes them (see the module docstring): the
    folds of the prompts it has touched, kept between steps."""

    def __init__(self, conn: Connection, *, run_id: int) -> None:
        self.run_id = run_id
        self.sql = _Sql(conn)
        self.folds: dict[int, tuple[PromptFold, _Named]] = {}
        self.last_step: int | None = conn.scalar(
            select(func.max(PromptGroupRow.step)).where(PromptGroupRow.run_id == run_id)
        )
        self.written: tuple[int, set[int]] | None = None  # the latest step's groups written

    def add(self, conn: Connection, *, step: int, groups: Sequence[NewGroup]) -> None:
        """Write the figures of these groups of `step` (their rollouts are written already)
        and fold them into their prompts."""
        if not groups:
            return
        if self.written is not None and self.written[0] == step:
            there = self.written[1]
        elif self.last_step is not None and step <= self.last_step:
            there = set(
                conn.scalars(
                    select(PromptGroupRow.group).where(
                        PromptGroupRow.run_id == self.run_id, PromptGroupRow.step == step
                    )
                )
            )
        else:
            there = set()
        again = sorted({g.group for g in groups if g.group in there})
        figures = {
            g.group: group_figures(g.rewards, g.true_scores, g.votes)
            for g in groups
            if g.group not in there
        }
        prompt_of = {g.group: g.prompt_id for g in groups}
        if again:  # the group's earlier rollouts are in the table: figure it from all of them
            figures.update(self._figured(conn, step, again))
            conn.execute(
                delete(PromptGroupRow).where(
                    PromptGroupRow.run_id == self.run_id,
                    PromptGroupRow.step == step,
                    PromptGroupRow.group.in_(again),
                )
            )
        self.sql.insert(
            conn,
            self.sql.insert_groups,
            [_group_row(self.run_id, step, g, prompt_of[g], figures[g]) for g in sorted(figures)],
        )
        self._load(conn, groups)
        refold: set[int] = set()
        for group in sorted(figures):
            prompt_id = prompt_of[group]
            fold = self.folds[prompt_id][0]
            if group in there or not fold.follows(step, group):
                refold.add(prompt_id)
            elif prompt_id not in refold:
                fold.add(step, group, figures[group])
        for prompt_id, fold in _refold_prompts(conn, run_id=self.run_id, prompt_ids=refold).items():
            self.folds[prompt_id] = (fold, self.folds[prompt_id][1])
        touched = sorted(set(prompt_of.values()))
        self.sql.insert(
            conn,
            self.sql.upsert_prompts,
            [_prompt_row(self.run_id, p, *self.folds[p]) for p in touched],
        )
        written = self.written[1] if self.written and self.written[0] == step else set()
        self.written = (step, written | set(prompt_of))
        self.last_step = step if self.last_step is None else max(self.last_step, step)

    def _figured(self, conn: Connection, step: int, groups: list[int]) -> dict[int, GroupFigures]:
        rows = conn.execute(
            select(
                RolloutRow.group,
                RolloutRow.verifier_reward,
                RolloutRow.true_score,
                RolloutRow.vote,
            ).where(
                RolloutRow.run_id == self.run_id,
                RolloutRow.step == step,
                RolloutRow.group.in_(groups),
            )
        ).all()
        members: dict[int, list[tuple[float | None, float | None, str | None]]] = {}
        for group, reward, true, vote in rows:
            members.setdefault(group, []).append((reward, true, vote))
        return {
            g: group_figures([m[0] for m in ms], [m[1] for m in ms], [m[2] for m in ms])
            for g, ms in members.items()
        }

    def _load(self, conn: Connection, groups: Sequence[NewGroup]) -> None:
        """The folds of these groups' prompts: from run_prompts, else new."""
        missing = sorted({g.prompt_id for g in groups} - set(self.folds))
        for start in range(0, len(missing), CHUNK):
            chunk = missing[start : start + CHUNK]
            for row in conn.execute(
                select(RunPromptRow.__table__).where(
                    RunPromptRow.run_id == self.run_id, RunPromptRow.prompt_id.in_(chunk)
                )
            ):
                self.folds[row.prompt_id] = (
                    _fold_from_row(row),
                    _Named(row.label, row.query_key, row.user_key, row.target),
                )
        for g in groups:
            if g.prompt_id not in self.folds:
                self.folds[g.prompt_id] = (PromptFold(), named(g.prompt, g.query, g.target))


def _group_row(
    run_id: int, step: int, group: int, prompt_id: int, g: GroupFigures
) -> tuple[object, ...]:
    return (
        run_id,
        step,
        group,
        prompt_id,
        g.size,
        g.reward_mean,
        g.reward_min,
        g.reward_max,
        g.reward_n,
        g.true_n,
        g.true_mean,
        g.correct,
        g.solved,
        g.zero_spread,
        g.agreement,
        _json(g.votes),
    )


def _prompt_row(run_id: int, prompt_id: int, fold: PromptFold, name: _Named) -> tuple[object, ...]:
    return (
        run_id,
        prompt_id,
        *(getattr(fold, c) for c in FOLD_COLUMNS),
        _json(fold.vote_pairs()),
        name.label,
        name.query_key,
        name.user_key,
        name.target,
    )


def _refold_prompts(
    conn: Connection | Session, *, run_id: int, prompt_ids: Iterable[int]
) -> dict[int, PromptFold]:
    """Fold these prompts again from their group rows, in (step, group) order (a prompt without
    groups folds to an empty PromptFold)."""
    wanted = sorted(set(prompt_ids))
    folds = {p: PromptFold() for p in wanted}
    for start in range(0, len(wanted), CHUNK):
        chunk = wanted[start : start + CHUNK]
        rows = conn.execute(
            select(PromptGroupRow.__table__)
            .where(PromptGroupRow.run_id == run_id, PromptGroupRow.prompt_id.in_(chunk))
            .order_by(PromptGroupRow.prompt_id, PromptGroupRow.step, PromptGroupRow.group)
        )
        for row in rows:
            folds[row.prompt_id].add(row.step, row.group, _figures_from_row(row))
    return folds


def forget_after(conn: Connection | Session, *, run_id: int, step: int) -> None:
    """Drop the groups generated after `step` (a resume truncates them) and fold the prompts
    they touched again from the groups left (a prompt left without any goes)."""
    touched = list(
        conn.scalars(
            select(PromptGroupRow.prompt_id)
            .where(PromptGroupRow.run_id == run_id, PromptGroupRow.step > step)
            .distinct()
        )
    )
    if not touched:
        return
    conn.execute(
        delete(PromptGroupRow).where(PromptGroupRow.run_id == run_id, PromptGroupRow.step > step)
    )
    for prompt_id, fold in _refold_prompts(conn, run_id=run_id, prompt_ids=touched).items():
        where = (RunPromptRow.run_id == run_id, RunPromptRow.prompt_id == prompt_id)
        if not fold.groups:
            conn.execute(delete(RunPromptRow).where(*where))
            continue
        values: dict[str, object] = {c: getattr(fold, c) for c in FOLD_COLUMNS}
        values["votes"] = [[v, c] for v, c in fold.vote_pairs()]
        conn.execute(update(RunPromptRow).where(*where).values(**values))


def delete_run(conn: Connection | Session, *, run_id: int) -> None:
    """A deleted run's prompt rollups."""
    for model in (PromptGroupRow, RunPromptRow):
        conn.execute(delete(model).where(model.run_id == run_id))
