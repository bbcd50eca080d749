"""The write path: a run's steps, their rollouts and series, its summary columns, rollups and
alerts — what a trainer writes every step, so it is built for speed.

A Recorder holds what the run's next write needs (series layout, rollup progress, the last 25
steps' means, the alert rules' windows, interned prompt and facts ids, token ids already known)
and writes one step in a handful of driver-level statements (SQL text made once). Only one
recorder writes a run at a time (the worker training it, the callback's writer, an import). If a write's transaction rolls
back, throw the recorder away and load a new one: its memory is ahead of the database.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

import numpy as np
import orjson
from rollout_lens.server.core import alerts as rules
from rollout_lens.server.core import mismatch, textsafe
from rollout_lens.server.core.errors import RolloutsTaken, StepOutOfOrder
from rollout_lens.server.core.prompt_rules import recorded_query
from rollout_lens.server.core.records import RolloutRecord, StepRecord, disagrees
from rollout_lens.server.core.vocab import MAX_SERIES_PER_RUN, STEP_SERIES, WINDOW
from rollout_lens.server.store import arrays, layout, prompt_rollups, prompt_texts, rollups, search
from rollout_lens.server.store.models import (
    AlertRow,
    Base,
    FactsRow,
    PromptRow,
    RunRow,
    RunTokenRow,
    StepRow,
    utcnow,
)
from rollout_lens.server.store.rule_match import PieceTables
from rollout_lens.server.store.sql import finite, upsert_insert
from sqlalchemy import JSON, Connection, String, select, update
from sqlalchemy.dialects import postgresql

log = logging.getLogger(__name__)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def json_text(value: Any) -> str:
    """JSON text of a rollout's own meta: orjson (json.dumps of 8 small dicts of probes was the
    write path's largest cost); NaN and infinities become null, as JSON has no such numbers.
    Anything orjson refuses (lone surrogates, exotic types, numpy's floats) goes through
    json.dumps, with the same nulls (textsafe.finite_json)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except (TypeError, orjson.JSONEncodeError):
        return textsafe.finite_json(value, ensure_ascii=False, default=str)


def canonical_json(value: Any) -> str:
    """The text a facts dict is hashed by: as it is stored (NaN and infinities as null)."""
    return textsafe.finite_json(value, sort_keys=True, ensure_ascii=False, default=str)


STEP_COLUMNS = (
    "run_id",
    "step",
    "rollout_step",
    *STEP_SERIES,
    "series",
    "tokens_kept",
    "recorded_at",
)
ROLLOUT_COLUMNS = (
    "run_id",
    "step",
    "group",
    "idx",
    "prompt_id",
    "target",
    "vote",
    "verifier_reward",
    "true_score",
    "advantage",
    "sum_logprob",
    "format_valid",
    "format_state",
    "disagree",
    "abs_diff_max",
    "log_seq_ratio",
    "n_tokens",
    "text_rule",
    "facts_id",
    "own_meta",
)
DATA_COLUMNS = ("rollout_id", "ids", "logprobs", "control", "text", "generator_logprobs")
ANALYZE_AT, ANALYZE_EVERY, ANALYZE_ROWS = (1, 10), 100, 2000
MAX_MASK_IDS = 1 << 22  # token ids the known-ids mask holds (larger ids are looked up in a dict)
ALERT_COLUMNS = ("run_id", "step", "kind", "series", "message")


class _Driver:
    """The every-step statements as the database driver takes them: SQL text made once, rows as
    tuples. Building and compiling SQLAlchemy statements per step cost more than the database's
    own work."""

    def __init__(self, conn: Connection) -> None:
        self.postgres = conn.dialect.name == "postgresql"
        mark = "%s" if self.postgres else "?"
        biggest = "greatest" if self.postgres else "max"

        def insert(table: str, columns: Sequence[str]) -> str:
            names = ", ".join(f'"{c}"' for c in columns)
            return f"INSERT INTO {table} ({names}) VALUES ({', '.join([mark] * len(columns))})"

        self.insert_step = insert("steps", STEP_COLUMNS)
        self.insert_rollouts = BulkInsert.of("rollouts", ROLLOUT_COLUMNS, self.postgres)
        self.insert_data = BulkInsert.of("rollout_data", DATA_COLUMNS, self.postgres)
        self.rollout_ids = (
            f'SELECT "group", idx, id FROM rollouts WHERE run_id = {mark} AND step = {mark}'
        )
        # whether a rollout step is written (a select built per step cost 0.4 ms of the
        # writer's thread, the GIL held, at a toy step)
        self.any_rollout = f"SELECT 1 FROM rollouts WHERE run_id = {mark} AND step = {mark} LIMIT 1"
        self.drop_arrays = (
            "UPDATE rollout_data SET logprobs = NULL, control = NULL, generator_logprobs = NULL "
            "WHERE rollout_id IN "
            f"(SELECT id FROM rollouts WHERE run_id = {mark} AND step = {mark})"
        )
        self.insert_alerts = insert("alerts", ALERT_COLUMNS)
        self.insert_tokens = BulkInsert.of(
            "run_tokens", ("run_id", "token_id", "text"), self.postgres, " ON CONFLICT DO NOTHING"
        )
        self.update_run = (
            f"UPDATE runs SET current_step = {biggest}(current_step, {mark}), "
            f"recent_true_accuracy = {mark}, recent_reward = {mark}, heartbeat_at = {mark}, "
            f"alerts_through = {biggest}(alerts_through, {mark}), "
            f"device_seconds = device_seconds + {mark}, cost = cost + {mark} WHERE id = {mark}"
        )
        self.update_names = f"UPDATE runs SET series_names = {mark} WHERE id = {mark}"

    def time(self, value: datetime) -> Any:
        """SQLAlchemy keeps SQLite times as naive UTC text; PostgreSQL takes the datetime."""
        if self.postgres:
            return value
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")

    def json(self, value: Any) -> Any:
        if value is None:
            return None
        if self.postgres:
            from psycopg.types.json import Json

            return Json(value, dumps=json_text)
        return json_text(value)

    @staticmethod
    def cursor(conn: Connection) -> Any:
        """Driver SQL through the connection (its errors wrapped as SQLAlchemy's, so writers
        tell a lost connection from a refused row)."""
        return DriverSql(conn)


class DriverSql:
    """Driver SQL on a connection, as the Recorder and the prompt rollups write rows."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.postgres = conn.dialect.name == "postgresql"

    def execute(self, sql: str, params: tuple[Any, ...]) -> None:
        self.conn.exec_driver_sql(sql, params)

    def executemany(self, sql: str, rows: list[tuple[Any, ...]], *, clean: bool = True) -> None:
        """`clean=False`: rows whose strings are storable already (a RolloutRecord's, cleaned
        as they were set): the engine's per-string check is skipped."""
        options = {} if clean else textsafe.CLEAN_ALREADY
        self.conn.exec_driver_sql(sql, rows, execution_options=options)

    def insert(self, bulk: BulkInsert, rows: list[tuple[Any, ...]], *, clean: bool = True) -> None:
        """Many rows into one table: on PostgreSQL one statement of a column's values an array
        (psycopg's executemany sends a statement a row, which cost more than the rows), on
        SQLite the one-row statement for each (sqlite3 prepares it once)."""
        if not rows:
            return
        if self.postgres:
            options = {} if clean else textsafe.CLEAN_ALREADY
            columns = tuple(list(column) for column in zip(*rows, strict=True))
            self.conn.exec_driver_sql(bulk.unnest, columns, execution_options=options)
            return
        self.executemany(bulk.single, rows, clean=clean)

    def fetch(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        return list(self.conn.exec_driver_sql(sql, params))


@dataclass(frozen=True)
class BulkInsert:
    """An INSERT of many rows as each database takes it fastest: `single` (one row, for an
    executemany) and `unnest` (PostgreSQL: every column an array, JSON sent as text)."""

    single: str
    unnest: str

    @classmethod
    def of(cls, table: str, columns: Sequence[str], postgres: bool, tail: str = "") -> BulkInsert:
        mark = "%s" if postgres else "?"
        names = ", ".join(f'"{c}"' for c in columns)
        single = f"INSERT INTO {table} ({names}) VALUES ({', '.join([mark] * len(columns))}){tail}"
        types: list[str] = []
        picks: list[str] = []
        dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
        for i, name in enumerate(columns):
            kind = Base.metadata.tables[table].c[name].type
            json = isinstance(kind, JSON)
            # text as TEXT: an explicit cast to VARCHAR(n) would cut a long value silently,
            # where the column's own assignment refuses it (as a one-row insert does)
            text = json or isinstance(kind, String)
            types.append("TEXT" if text else kind.compile(dialect=dialect))
            picks.append(f"c{i}::json" if json else f"c{i}")
        # Each array in psycopg's binary format (`%b`): in its text format a step's bytea arrays
        # went as hex, written out by the client and parsed back by the server (rollout_data's
        # 512 rows of a full-shape step: 77 ms as text, 18 ms in binary).
        arrays = ", ".join(f"%b::{t}[]" for t in types)
        aliases = ", ".join(f"c{i}" for i in range(len(columns)))
        unnest = (
            f"INSERT INTO {table} ({names}) SELECT {', '.join(picks)} "
            f"FROM unnest({arrays}) AS u({aliases}){tail}"
        )
        return cls(single, unnest)


class RunTokens:
    """The run's token texts (id → the piece convert_ids_to_tokens gave, the first one given):
    what rebuilds a completion's text from its ids; held as a dict and, for ids that fit, as a
    mask and an array of texts (a step's ids are checked at once)."""

    def __init__(self, conn: Connection, *, run_id: int) -> None:
        self.run_id = run_id
        self.texts: dict[int, str] = {
            token_id: text
            for token_id, text in conn.execute(
                select(RunTokenRow.token_id, RunTokenRow.text).where(RunTokenRow.run_id == run_id)
            )
        }
        self._known: np.ndarray | None = None  # the texts' ids as a mask (_known_ids)
        self._pieces = PieceTables(self.texts, 0)  # and their bytes under each rule, by id

    def add(self, driver: _Driver, conn: Connection, rollouts: Sequence[RolloutRecord]) -> None:
        """Store the text of each token id not seen before in this run (the first text given
        for an id is its text): the step's ids checked at once against the ids known."""
        given = [
            (r.completion_ids, texts)
            for r in rollouts
            if (texts := r.tokens if r.tokens is not None else r.meta.get("tokens"))
            and len(texts) == len(r.completion_ids)
        ]
        if not given:
            return
        ids = np.concatenate([np.asarray(i, dtype=np.int64).reshape(-1) for i, _ in given])
        known = self._known_ids(int(ids.max(initial=0)))
        inside = (ids >= 0) & (ids < len(known))
        unseen = np.flatnonzero(~known[np.where(inside, ids, 0)] | ~inside)
        if not unseen.size:
            return
        new_ids, first = np.unique(ids[unseen], return_index=True)
        at = unseen[first]  # where each new id first appears in the step
        ends = np.cumsum([len(t) for _, t in given])
        owner = np.searchsorted(ends, at, side="right")
        starts = np.concatenate(([0], ends[:-1]))
        new: dict[int, str] = {}
        for token_id, rollout, position in zip(
            new_ids.tolist(), owner.tolist(), (at - starts[owner]).tolist(), strict=True
        ):
            if token_id not in self.texts:  # a negative or huge id the mask cannot hold
                new[token_id] = str(given[rollout][1][position])
        if new:
            driver.cursor(conn).insert(
                driver.insert_tokens,
                [(self.run_id, i, t) for i, t in new.items()],
                clean=False,
            )
            self.texts.update(new)
            self._learn(new)

    def _known_ids(self, largest: int) -> np.ndarray:
        """token id → whether the run has its text, as a mask at least `largest` + 1 long (a
        vocabulary's ids are below a few hundred thousand; larger ones stay in the dict)."""
        if self._known is None or (len(self._known) <= largest < MAX_MASK_IDS):
            size = max(largest + 1, 2 * len(self._known) if self._known is not None else 0)
            size = min(max(size, 1 << 16), MAX_MASK_IDS)
            self._known = np.zeros(size, dtype=bool)
            self._pieces = PieceTables(self.texts, size)
            self._learn(self.texts)
        return self._known

    def _learn(self, texts: dict[int, str]) -> None:
        """Token texts new to the run into the mask (ids that fit) and the pieces' tables."""
        if self._known is None:
            return
        held = [i for i in texts if 0 <= i < len(self._known)]
        self._known[held] = True
        self._pieces.learn(held)

    def text_rules(self, rollouts: Sequence[RolloutRecord]) -> list[int | None]:
        """arrays.text_rule of each rollout: for the rollouts whose ids the mask holds, all
        at once from the run's pieces' bytes (rule_match); a rollout with an id the mask does
        not hold (negative, huge, unseen) is looked up in the dict."""
        rows = [np.asarray(r.completion_ids, dtype=np.int64).reshape(-1) for r in rollouts]
        ids = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        if not len(ids):
            return [None] * len(rollouts)
        known = self._known_ids(int(ids.max()))
        inside = (ids >= 0) & (ids < len(known))
        held = inside & known[np.where(inside, ids, 0)]
        # ids not held in each rollout: the running count, read at the rollouts' bounds
        bounds = np.cumsum([0, *map(len, rows)])
        running = np.concatenate(([0], np.cumsum(~held)))
        missing = running[bounds[1:]] - running[bounds[:-1]]
        usable = (missing == 0) & (bounds[1:] > bounds[:-1])
        out = self._pieces.rules(
            np.where(held, ids, 0), bounds, [r.completion for r in rollouts], usable
        )
        for i in np.flatnonzero(missing).tolist():
            out[i] = arrays.text_rule(rollouts[i].completion, rows[i], self.texts)
        return out


class Interned:
    """Each distinct prompt text and facts dict stored once, by sha256; the ids of those this
    run wrote or looked up, so that a run's few distinct prompts are looked up once."""

    def __init__(self, words: search.WordNumbers | None = None) -> None:
        self.prompt_ids: dict[str, int] = {}
        self.prompt_shas: dict[str, str] = {}
        self.facts_ids: dict[str, int] = {}
        self.words = words  # PostgreSQL: the writer's word numbers, for new prompts' words

    def prompt_sha(self, text: str) -> str:
        """sha256 of a prompt, remembered by text (a dict lookup costs far less than hashing a
        64-tool listing again for every rollout of every step)."""
        digest = self.prompt_shas.get(text)
        if digest is None:
            if len(self.prompt_shas) > 4096:
                self.prompt_shas.clear()
            digest = self.prompt_shas[text] = sha256_text(text)
        return digest

    def intern(
        self,
        conn: Connection,
        model: Any,
        cache: dict[str, int],
        wanted: dict[str, Any],
        columns: Callable[[Sequence[Any]], list[dict[str, Any]]],
    ) -> dict[str, int]:
        """Store each distinct prompt text (or facts dict) once, by sha256, as `columns` gives
        the rows' other columns; return the cache of sha256 → id (a run's few distinct prompts
        are looked up once, not every step). Those stored already are looked up first, so
        that only new ones are packed (a run whose prompts another run wrote makes no prompt
        dictionary)."""
        missing = [h for h in wanted if h not in cache]
        if missing:
            cache.update(_ids_of(conn, model, missing))
        new = {h: wanted[h] for h in missing if h not in cache}
        if new:
            rows = columns(list(new.values()))
            # many parameter sets to one statement (SQLAlchemy's insertmanyvalues): compiled
            # once a run, where a VALUES list of each step's length compiled every step
            inserted = conn.execute(
                upsert_insert(conn, model)
                .on_conflict_do_nothing(index_elements=["sha256"])
                .returning(model.id, model.sha256),
                [{"sha256": h, **row} for h, row in zip(new, rows, strict=True)],
            ).all()
            if model is PromptRow:  # new prompts become searchable (not those another run added)
                search.index_prompts(
                    conn, [(row_id, new[h]) for row_id, h in inserted], words=self.words
                )
            cache.update({digest: row_id for row_id, digest in inserted})
            if len(inserted) < len(new):  # another writer stored some of them meanwhile
                cache.update(_ids_of(conn, model, [h for h in new if h not in cache]))
        return cache


def _ids_of(conn: Connection, model: Any, digests: Sequence[str]) -> dict[str, int]:
    """sha256 → id of those of these prompts (or facts) that are stored."""
    rows = conn.execute(select(model.sha256, model.id).where(model.sha256.in_(digests)))
    return {digest: row_id for digest, row_id in rows}


class Retention:
    """Which rollouts keep their token arrays: the newest are kept until the next arrive, then
    dropped unless a reason to keep them was found (every N steps, the first step, an
    alert)."""

    def __init__(self, conn: Connection, *, run_id: int, every: int | None, resumed: bool) -> None:
        self.run_id = run_id
        self.every = every
        self.first_step: int | None = conn.scalar(
            select(StepRow.step).where(StepRow.run_id == run_id).order_by(StepRow.step).limit(1)
        )
        self.newest: tuple[int, bool] | None = None  # (its rollout step, kept)
        if resumed:
            newest = conn.execute(
                select(StepRow.step, StepRow.rollout_step)
                .where(StepRow.run_id == run_id)
                .order_by(StepRow.step.desc())
                .limit(1)
            ).one()
            fired = conn.scalar(
                select(AlertRow.id).where(AlertRow.run_id == run_id, AlertRow.step == newest[0])
            )
            self.newest = (newest[1], self.keeps(newest[1], fired is not None))

    def keeps(self, step: int, fired: bool) -> bool:
        """Whether retention keeps the token arrays of the rollouts generated at `step`."""
        every = self.every
        return every is None or fired or step % every == 0 or step == self.first_step

    def step(self, conn: Connection, driver: _Driver, record: StepRecord, fired: bool) -> None:
        """A step written: its new rollouts retire the newest ones before them (their token
        arrays dropped unless kept); whether its own are kept."""
        if record.rollouts:
            self._retire_newest(conn, driver, record.rollout_step)
        if self.first_step is None or record.step < self.first_step:
            self.first_step = record.step
        keep = self.keeps(record.rollout_step, fired)
        if self.newest is None or self.newest[0] != record.rollout_step:
            self.newest = (record.rollout_step, keep)
        else:
            self.newest = (self.newest[0], self.newest[1] or keep)

    def _retire_newest(self, conn: Connection, driver: _Driver, rollout_step: int) -> None:
        """New rollouts arrived: drop the previous newest ones' token arrays unless kept."""
        if self.newest is None or self.newest[0] == rollout_step or self.newest[1]:
            return
        old = self.newest[0]
        driver.cursor(conn).execute(driver.drop_arrays, (self.run_id, old))
        conn.execute(
            update(StepRow)
            .where(StepRow.run_id == self.run_id, StepRow.rollout_step == old)
            .values(tokens_kept=False)
        )


class Recorder:
    """Writes the steps of one run (see the module docstring)."""

    def __init__(self, conn: Connection, *, run_id: int, control_tokens: Sequence[str]) -> None:
        self.driver = _Driver(conn)
        self.run_id = run_id
        self.control_tokens = list(control_tokens)
        run = conn.execute(
            select(RunRow.series_names, RunRow.keep_tokens_every, RunRow.prompts_per_step).where(
                RunRow.id == run_id
            )
        ).one()
        self.series_names: list[str] = list(run.series_names or [])
        self.known_series = set(self.series_names)  # membership at any number of names
        self.refused_series = 0  # names past MAX_SERIES_PER_RUN, not recorded
        self.buckets = rollups.OpenBuckets(conn, run_id=run_id, n_series=len(self.series_names))
        self.prompts = prompt_rollups.PromptRollup(conn, run_id=run_id)
        history = conn.execute(
            select(StepRow.step, *layout.STEP_COLUMNS, StepRow.series)
            .where(StepRow.run_id == run_id)
            .order_by(StepRow.step.desc())
            .limit(rules.CONTEXT)
        ).all()[::-1]
        names = layout.all_names(self.series_names)
        self.recent: deque[tuple[float | None, float | None]] = deque(maxlen=WINDOW)
        self.watch = rules.Watch(rules.AlertThresholds().for_run(run.prompts_per_step))
        for row in history:
            values = dict(zip(names, layout.row_values(row, len(self.series_names)), strict=True))
            self.recent.append((values["true_accuracy"], values["reward_mean"]))
            self.watch.feed(row[0], values)
        self.last_step: int | None = history[-1][0] if history else None
        self.retention = Retention(
            conn, run_id=run_id, every=run.keep_tokens_every or None, resumed=bool(history)
        )
        self.tokens = RunTokens(conn, run_id=run_id)
        self.words = search.WordNumbers()  # PostgreSQL: the search words this writer numbered
        self.interned = Interned(self.words)
        self.packer = prompt_texts.Packer(run_id)
        self.written = 0  # steps this recorder wrote (SQLite's statistics are refreshed by it)
        self.index_seconds = 0.0  # the last index_written's (the scale bench prints it)
        # Rollouts written but not yet searchable: indexed right after their step's commit
        # (write_batch), or, after a crash between the two, when the next recorder starts.
        self.unindexed: list[tuple[int, str]] = search.unindexed(
            conn, run_id=run_id, token_texts=self.tokens.texts
        )

    @property
    def token_texts(self) -> dict[int, str]:
        return self.tokens.texts

    # -- a step --------------------------------------------------------------------------------

    def write(
        self,
        conn: Connection,
        record: StepRecord,
        *,
        recorded_at: datetime | None = None,
        device_seconds: float = 0.0,
        price_per_hour: float = 0.0,
        index: bool = True,
    ) -> list[rules.FiredAlert]:
        """Write one step (inside the caller's transaction); return the alerts it fired.
        `index`: its rollouts are searchable in this transaction, else at the next `index`."""
        step = record.step
        if self.last_step is not None and step < self.last_step:
            raise StepOutOfOrder(step=step, last=self.last_step)  # before any write of it
        if record.rollouts and self._has_rollouts(conn, record.rollout_step):
            raise RolloutsTaken(step=step, rollout_step=record.rollout_step)  # and this too
        values = {name: finite(record.values.get(name)) for name in STEP_SERIES}
        metrics, new_names = self._series(step, record.metrics)
        self.buckets.add(
            conn, step, [*values.values(), *(metrics.get(n) for n in self.series_names)]
        )
        fired = self.watch.push(step, values | {n: v for n, v in metrics.items() if v is not None})
        self.retention.step(conn, self.driver, record, bool(fired))
        driver = self.driver
        cursor = driver.cursor(conn)
        cursor.execute(
            driver.insert_step,
            (
                self.run_id,
                step,
                record.rollout_step,
                *values.values(),
                layout.encode(metrics, self.series_names),
                True,
                driver.time(recorded_at or utcnow()),
            ),
        )
        self.add_rollouts(
            conn, step=record.rollout_step, rollouts=record.rollouts, cursor=cursor, index=index
        )
        if index:
            self.index(conn)
        if fired:
            cursor.executemany(
                driver.insert_alerts,
                [(self.run_id, a.step, a.kind, a.series, a.message) for a in fired],
            )
        if new_names:
            cursor.execute(driver.update_names, (driver.json(self.series_names), self.run_id))
        self.recent.append((values["true_accuracy"], values["reward_mean"]))
        self.last_step = step
        self.written += 1
        self._update_run(
            conn, cursor, step, device_seconds, device_seconds / 3600.0 * price_per_hour
        )
        return fired

    def _series(
        self, step: int, given: dict[str, float | None]
    ) -> tuple[dict[str, float | None], list[str]]:
        """The step's generic series (finite or None) within the run's cap, and the names new to
        the run (added to its series names)."""
        metrics = {name: finite(value) for name, value in given.items()}
        new_names = [n for n in metrics if n not in self.known_series]
        room = max(0, MAX_SERIES_PER_RUN - len(self.series_names))
        if len(new_names) > room:
            self._refuse_series(step, new_names[room:], metrics)
            new_names = new_names[:room]
        self.series_names += new_names
        self.known_series.update(new_names)
        return metrics, new_names

    def _update_run(
        self, conn: Connection, cursor: Any, step: int, device_seconds: float, cost: float
    ) -> None:
        """The run's summary columns after a step (and SQLite's statistics, now and then)."""
        if not self.driver.postgres and (
            self.written in ANALYZE_AT or self.written % ANALYZE_EVERY == 0
        ):
            # SQLite plans by the statistics ANALYZE keeps (PostgreSQL's autovacuum keeps its
            # own): without them the explorer's filters pick the wrong index as a run grows.
            conn.exec_driver_sql(f"PRAGMA analysis_limit = {ANALYZE_ROWS}")
            conn.exec_driver_sql("ANALYZE rollouts")
        cursor.execute(
            self.driver.update_run,
            (
                step,
                _mean(a for a, _ in self.recent),
                _mean(r for _, r in self.recent),
                self.driver.time(utcnow()),
                step,
                device_seconds,
                cost,
                self.run_id,
            ),
        )

    def _refuse_series(self, step: int, names: Sequence[str], metrics: dict[str, Any]) -> None:
        """Names past the run's cap are not recorded (the rest of the step is), with a warning
        the first time (imports refuse such a file before they write: server.exchange)."""
        for name in names:
            del metrics[name]
        if not self.refused_series:
            log.warning(
                "run %d, step %d: %d new series names not recorded (%s, …): a run holds at "
                "most %d; the rest of the step is recorded",
                self.run_id,
                step,
                len(names),
                names[0][:80],
                MAX_SERIES_PER_RUN,
            )
        self.refused_series += len(names)

    def _has_rollouts(self, conn: Connection, rollout_step: int) -> bool:
        """Whether the run has rollouts generated at `rollout_step` (their unique key's index:
        a step re-sending them would otherwise fail on that key, after its other writes)."""
        return bool(
            self.driver.cursor(conn).fetch(self.driver.any_rollout, (self.run_id, rollout_step))
        )

    # -- rollouts ------------------------------------------------------------------------------

    def add_rollouts(
        self,
        conn: Connection,
        *,
        step: int,
        rollouts: Sequence[RolloutRecord],
        cursor: Any = None,
        index: bool = True,
    ) -> None:
        """Write rollouts generated at `step` (write calls it; an import may call it alone);
        `index`: searchable in this transaction, else at the next `index` call."""
        if not rollouts:
            return
        prompts, prompt_ids = self._prompts(conn, rollouts)
        facts_ids, digests, own = self._facts(conn, rollouts)
        self.tokens.add(self.driver, conn, rollouts)
        rules = self.tokens.text_rules(rollouts)
        driver = self.driver
        cursor = cursor or driver.cursor(conn)
        figures = rollout_mismatch(rollouts)
        cursor.insert(
            driver.insert_rollouts,
            [
                _rollout_row(
                    self.run_id, step, r, prompt_ids[p], facts_ids[d] if d else None, o, rule, f
                )
                for r, p, d, o, rule, f in zip(
                    rollouts, prompts, digests, own, rules, figures, strict=True
                )
            ],
            clean=False,
        )
        ids = {(g, i): rid for g, i, rid in cursor.fetch(driver.rollout_ids, (self.run_id, step))}
        rollout_ids = [ids[(r.group, r.index)] for r in rollouts]
        ctrl = self.control_tokens
        blobs = arrays.encode_rollouts(
            [r.completion_ids for r in rollouts],
            [r.token_logprobs for r in rollouts],
            [r.control_probs.ordered(ctrl) for r in rollouts],
        )
        cursor.insert(
            driver.insert_data,
            [
                (
                    rid,
                    *blob,
                    None if rule is not None else arrays.encode_text(r.completion),
                    _generator_blob(r),
                )
                for r, rid, rule, blob in zip(rollouts, rollout_ids, rules, blobs, strict=True)
            ],
            clean=False,
        )
        self.unindexed += [
            (rid, r.completion) for r, rid in zip(rollouts, rollout_ids, strict=True)
        ]
        self.prompts.add(conn, step=step, groups=_groups(rollouts, prompts, prompt_ids))
        if index:
            self.index(conn)

    def _prompts(
        self, conn: Connection, rollouts: Sequence[RolloutRecord]
    ) -> tuple[list[str], dict[str, int]]:
        """Each rollout's prompt digest, and each digest's prompt id (new prompts stored)."""
        interned = self.interned
        prompts = [interned.prompt_sha(r.prompt) for r in rollouts]
        prompt_ids = interned.intern(
            conn,
            PromptRow,
            interned.prompt_ids,
            dict(zip(prompts, (r.prompt for r in rollouts), strict=True)),
            partial(self.packer.pack, conn),
        )
        return prompts, prompt_ids

    def _facts(
        self, conn: Connection, rollouts: Sequence[RolloutRecord]
    ) -> tuple[dict[str, int], list[str | None], list[dict[str, Any]]]:
        """The rollouts' shared facts stored once (sha256 → id), each rollout's facts digest
        (None: none) and the meta of its own."""
        facts, own = _split_meta(rollouts)
        by_object: dict[int, str] = {}  # a group's rollouts share one facts dict: hash it once
        digests: list[str | None] = []
        for f in facts:
            if f and id(f) not in by_object:
                by_object[id(f)] = sha256_text(canonical_json(f))
            digests.append(by_object[id(f)] if f else None)
        facts_ids = self.interned.intern(
            conn,
            FactsRow,
            self.interned.facts_ids,
            {d: f for d, f in zip(digests, facts, strict=True) if d},
            lambda found: [{"data": f} for f in found],
        )
        return facts_ids, digests, own

    def index(self, conn: Connection) -> None:
        """Make the rollouts written so far searchable (in the caller's transaction)."""
        self.words.begin()
        if self.unindexed:
            rows = self.unindexed
            search.index_rollouts(conn, run_id=self.run_id, rows=rows, words=self.words)
            self.unindexed = []

    def index_failed(self, rows: list[tuple[int, str]]) -> None:
        """The transaction of `index` failed and this recorder is kept (writing.index_written):
        its rollouts `rows` wait again, and the word numbers it found are not the database's."""
        self.words.discard()
        if self.unindexed is not rows:  # index took them before the commit failed
            self.unindexed = rows + self.unindexed


def _generator_blob(rollout: RolloutRecord) -> bytes | None:
    """The generator's logprobs in the logprobs' codec; None (NULL) where the path gave none."""
    found = rollout.generator_logprobs
    return None if found is None else arrays.encode_logprobs(found)


def _rollout_row(
    run_id: int,
    step: int,
    r: RolloutRecord,
    prompt_id: int,
    facts_id: int | None,
    own: dict[str, Any],
    rule: int | None,
    figures: tuple[float | None, float | None],
) -> tuple[Any, ...]:
    """A rollout's row of the rollouts table (its arrays go to rollout_data apart); `figures`:
    its mismatch columns (rollout_mismatch)."""
    return (
        run_id,
        step,
        r.group,
        r.index,
        prompt_id,
        r.target,
        r.vote,
        float(r.verifier_reward),
        finite(r.true_score),
        float(r.advantage),
        _not_nan(r.sum_logprob),
        None if r.format_valid is None else bool(r.format_valid),
        r.format_state,
        disagrees(r.verifier_reward, r.true_score),
        *figures,
        # no ids for a text (an import of text alone): its length is not known
        len(r.completion_ids) if len(r.completion_ids) or not r.completion else None,
        rule,
        facts_id,
        json_text(own) if own else None,  # text on both (PostgreSQL casts it)
    )


def rollout_mismatch(rollouts: Sequence[RolloutRecord]) -> list[tuple[float | None, float | None]]:
    """Each rollout's largest |Δlogp| and log sequence ratio (mismatch.rollout_figures, all the
    step's rollouts in one pass) over its two sides' logprobs as the store keeps them
    (arrays.stored_logprobs: 1/4096 nat, floored at −15), so that every write path (the
    callback's, the wire's, which receives them so, the imports') and migration 0021's
    backfill store the same figures, and the explorer's columns equal what the drill-down reads
    from the arrays. (None, None): no generator side, sides of different lengths, or no token
    to compare."""
    out: list[tuple[float | None, float | None]] = [(None, None)] * len(rollouts)
    chosen = [
        i
        for i, r in enumerate(rollouts)
        if r.generator_logprobs is not None
        and len(r.generator_logprobs)
        and len(r.generator_logprobs) == len(r.token_logprobs)
    ]
    if not chosen:
        return out
    trainer, generator = (
        arrays.stored_logprobs(np.concatenate(side))
        for side in zip(
            *((rollouts[i].token_logprobs, rollouts[i].generator_logprobs) for i in chosen),
            strict=True,
        )
    )
    cuts = np.cumsum([len(rollouts[i].token_logprobs) for i in chosen])[:-1]
    tokens = mismatch.pool(
        [
            mismatch.Sides(t, g)
            for t, g in zip(np.split(trainer, cuts), np.split(generator, cuts), strict=True)
        ]
    )
    figures = mismatch.each_rollout(tokens.log_ratios(), tokens.counts())
    for i, found in zip(chosen, figures, strict=True):
        if found is not None:
            out[i] = (found.abs_diff_max, found.log_seq_ratio)
    return out


def _groups(
    rollouts: Sequence[RolloutRecord], shas: Sequence[str], prompt_ids: dict[str, int]
) -> list[prompt_rollups.NewGroup]:
    """The rollouts by group, as the per-prompt rollups take them (a group's prompt, query and
    target are its first rollout's)."""
    out: dict[int, prompt_rollups.NewGroup] = {}
    for r, sha in zip(rollouts, shas, strict=True):
        g = out.get(r.group)
        if g is None:
            g = out[r.group] = prompt_rollups.NewGroup(
                r.group, prompt_ids[sha], r.prompt, recorded_query(r.meta), r.target, [], [], []
            )
        g.rewards.append(finite(r.verifier_reward))
        g.true_scores.append(finite(r.true_score))
        g.votes.append(r.vote)
    return list(out.values())


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
        first = metas[0]
        shared = {
            k
            for k in keys
            if k in first and all(k in m and (m[k] is first[k] or m[k] == first[k]) for m in metas)
        }
        group_facts = {k: v for k, v in first.items() if k in shared}
        for i, meta in zip(members, metas, strict=True):
            facts[i] = group_facts
            own[i] = {k: v for k, v in meta.items() if k not in shared}
    return facts, own


def _not_nan(value: float | None) -> float | None:
    """Σ logprob keeps -inf (a token the policy gave no mass); NaN is no number: NULL."""
    return None if value is None or value != value else value


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
