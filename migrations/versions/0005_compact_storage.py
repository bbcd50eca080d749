"""compact storage: packed per-step series, packed rollups, facts once per group, token texts
once per run, float16 token arrays, alerts written with their step, retention

Moves every existing run to the new layout without losing a rollout: metric rows become each
step's packed `series`; rollouts' meta is split into shared facts and their own keys, its token
texts go to run_tokens; float32 logprobs and control-token probabilities become float16;
rollups and alerts are computed from the steps, as the recorder writes them.

This file carries its own copy of everything it computes, frozen on 2026-12-01 from the code the
recorder then used: the series layout (server/store/layout.py), the float packings
(server/store/packing.py), the facts digest (server/store/recording.py), the rollups
(server/store/rollups.py) and the alert rules with the series names they read
(server/core/alerts.py, server/core/vocab.py). Those may change later; what this migration writes may
not. It imports nothing from rollout_lens.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 10:10:00
"""

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 2000


def upgrade() -> None:
    op.create_table(
        "facts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_facts")),
        sa.UniqueConstraint("sha256", name=op.f("uq_facts_sha256")),
    )
    op.create_table(
        "run_tokens",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("token_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_tokens_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "token_id", name=op.f("pk_run_tokens")),
    )
    op.create_table(
        "rollups",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("width", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("bucket", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_rollups_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "width", "bucket", name=op.f("pk_rollups")),
    )
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("series", sa.String(length=200), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_alerts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
    )
    op.create_index("ix_alerts_run_step", "alerts", ["run_id", "step"], unique=False)
    # Plain ADD COLUMN on runs: a batch rebuild of runs on SQLite would cascade-delete steps.
    op.add_column("runs", sa.Column("series_names", sa.JSON(), server_default="[]", nullable=False))
    op.add_column("runs", sa.Column("keep_tokens_every", sa.Integer(), nullable=True))
    op.add_column(
        "runs", sa.Column("alerts_through", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column("steps", sa.Column("series", sa.LargeBinary(), nullable=True))
    op.add_column(
        "steps", sa.Column("tokens_kept", sa.Boolean(), server_default=sa.true(), nullable=False)
    )
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("facts_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("own_meta", sa.JSON(), nullable=True))
        for column in ("completion_ids", "token_logprobs", "control_probs"):
            batch_op.alter_column(column, existing_type=sa.LargeBinary(), nullable=True)
        batch_op.alter_column("sum_logprob", existing_type=sa.Float(), nullable=True)
        batch_op.create_foreign_key(
            batch_op.f("fk_rollouts_facts_id_facts"), "facts", ["facts_id"], ["id"]
        )
        batch_op.create_index(batch_op.f("ix_rollouts_facts_id"), ["facts_id"], unique=False)

    conn = op.get_bind()
    for (run_id,) in conn.execute(sa.text("SELECT id FROM runs ORDER BY id")).all():
        _move_series(conn, run_id)
        _move_rollouts(conn, run_id)
        _derive(conn, run_id)

    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.drop_column("meta")
    op.drop_table("series_rollups")
    op.drop_index("ix_metrics_run_step", table_name="metrics")
    op.drop_table("metrics")


def _move_series(conn: sa.Connection, run_id: int) -> None:
    """Metric rows → each step's packed series, names in order of first appearance."""
    names: list[str] = []
    by_step: dict[int, dict[str, float | None]] = {}
    rows = conn.execute(
        sa.text("SELECT step, name, value FROM metrics WHERE run_id = :r ORDER BY step, name"),
        {"r": run_id},
    )
    for step, name, value in rows:
        if name not in names:
            names.append(name)
        by_step.setdefault(step, {})[name] = value  # None: logged without a finite value
    conn.execute(
        sa.text("UPDATE runs SET series_names = :n WHERE id = :r"),
        {"n": json.dumps(names), "r": run_id},
    )
    updates = [
        {"s": _encode(values, names), "r": run_id, "step": step}
        for step, values in by_step.items()
    ]
    for start in range(0, len(updates), BATCH):
        conn.execute(
            sa.text("UPDATE steps SET series = :s WHERE run_id = :r AND step = :step"),
            updates[start : start + BATCH],
        )


def _move_rollouts(conn: sa.Connection, run_id: int) -> None:
    """Meta → facts (what the group shares) and own keys; token texts → run_tokens; float32 →
    float16 arrays. The same split the recorder made (server.store.recording)."""
    tokens: dict[int, str] = {}
    after = -1
    while True:
        rows = conn.execute(
            sa.text(
                "SELECT id, step, \"group\", meta, completion_ids, token_logprobs, control_probs"
                " FROM rollouts WHERE run_id = :r AND id > :after ORDER BY id LIMIT :n"
            ),
            {"r": run_id, "after": after, "n": BATCH},
        ).all()
        if not rows:
            break
        after = rows[-1][0]
        groups: dict[tuple[int, int], list[tuple[int, dict]]] = {}
        arrays = {}
        for rid, step, group, meta, ids, logprobs, control in rows:
            meta = json.loads(meta) if isinstance(meta, str) else dict(meta or {})
            texts = meta.pop("tokens", None)
            token_ids = _unpack("i", ids)
            if isinstance(texts, list) and len(texts) == len(token_ids):
                for token_id, text in zip(token_ids, texts):
                    tokens.setdefault(token_id, str(text))
            groups.setdefault((step, group), []).append((rid, meta))
            arrays[rid] = (_pack_halves(_unpack("f", logprobs)), _pack_halves(_unpack("f", control)))
        updates = []
        for members in groups.values():
            # A group split across two batches shares less; nothing is lost either way.
            metas = [m for _, m in members]
            keys = set().union(*metas)
            shared = {
                k for k in keys if all(k in m for m in metas) and len({_dumps(m[k]) for m in metas}) == 1
            }
            for rid, meta in members:
                facts = {k: v for k, v in meta.items() if k in shared}
                own = {k: v for k, v in meta.items() if k not in shared}
                facts_id = None
                if facts:
                    digest = _sha(_dumps(facts))
                    facts_id = conn.execute(
                        sa.text("SELECT id FROM facts WHERE sha256 = :h"), {"h": digest}
                    ).scalar()
                    if facts_id is None:
                        conn.execute(
                            sa.text("INSERT INTO facts (sha256, data) VALUES (:h, :d)"),
                            {"h": digest, "d": json.dumps(facts, ensure_ascii=False)},
                        )
                        facts_id = conn.execute(
                            sa.text("SELECT id FROM facts WHERE sha256 = :h"), {"h": digest}
                        ).scalar()
                logprobs, control = arrays[rid]
                updates.append(
                    {
                        "id": rid,
                        "f": facts_id,
                        "o": json.dumps(own, ensure_ascii=False) if own else None,
                        "l": logprobs,
                        "c": control,
                    }
                )
        conn.execute(
            sa.text(
                "UPDATE rollouts SET facts_id = :f, own_meta = :o, token_logprobs = :l,"
                " control_probs = :c WHERE id = :id"
            ),
            updates,
        )
    if tokens:
        conn.execute(
            sa.text("INSERT INTO run_tokens (run_id, token_id, text) VALUES (:r, :i, :t)"),
            [{"r": run_id, "i": i, "t": t} for i, t in sorted(tokens.items())],
        )


def _derive(conn: sa.Connection, run_id: int) -> None:
    """Rollups of finished buckets and the alerts of the whole history, as the recorder would
    have written them."""
    raw = conn.execute(
        sa.text("SELECT series_names FROM runs WHERE id = :r"), {"r": run_id}
    ).scalar()
    # PostgreSQL's driver hands JSON back parsed, SQLite's as text
    names = raw if isinstance(raw, list) else json.loads(raw or "[]")
    last = conn.execute(
        sa.text("SELECT max(step) FROM steps WHERE run_id = :r"), {"r": run_id}
    ).scalar()
    if last is None:
        return
    for width in ROLLUP_WIDTHS:
        finished = (last - 1) // width - 1
        if finished >= 0:
            _roll(conn, run_id=run_id, width=width, first=0, last=finished, n_series=len(names))
    layout_names = [*STEP_SERIES, *names]
    history = [
        (step, dict(zip(layout_names, values)))
        for step, values in _step_rows(conn, run_id=run_id, after=0, through=None, n_series=len(names))
    ]
    per_step = conn.execute(
        sa.text("SELECT prompts_per_step FROM runs WHERE id = :r"), {"r": run_id}
    ).scalar()
    found = _evaluate(_from_history(history), _Thresholds(groups_per_step=max(1, per_step or 1)))
    if found:
        conn.execute(
            sa.text(
                "INSERT INTO alerts (run_id, step, kind, series, message)"
                " VALUES (:r, :s, :k, :n, :m)"
            ),
            [{"r": run_id, "s": a.step, "k": a.kind, "n": a.series, "m": a.message} for a in found],
        )
    conn.execute(
        sa.text("UPDATE runs SET alerts_through = :s WHERE id = :r"), {"s": last, "r": run_id}
    )


# --- frozen: packing (server/store/packing.py), the facts digest (server/store/recording.py) ---------


def _unpack(code: str, data: bytes | None) -> list:
    """Little-endian int32 ("i"), float32 ("f") or float64 ("d") bytes → values."""
    if not data:
        return []
    return list(struct.unpack(f"<{len(data) // struct.calcsize(code)}{code}", data))


def _pack_doubles(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


_HALF_MAX = 65504.0


def _pack_halves(values: Sequence[float]) -> bytes:
    """float16, little-endian; finite values beyond ±65504 clip to it (NaN, ±inf as they are)."""
    try:
        return struct.pack(f"<{len(values)}e", *values)
    except OverflowError:
        return struct.pack(
            f"<{len(values)}e",
            *(v if v != v or math.isinf(v) else min(max(v, -_HALF_MAX), _HALF_MAX) for v in values),
        )


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _dumps(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


# --- frozen: the series layout (server/store/layout.py) ----------------------------------------

# The step columns (server.core.vocab.STEP_SERIES), then the run's generic series in `series` in the
# order of runs.series_names: float64, a quiet NaN where not logged, NaN payload 1 where logged
# without a finite value.
STEP_SERIES = (
    "reward_mean",
    "true_accuracy",
    "format_valid_rate",
    "vote_agreement",
    "vote_entropy",
    "zero_std_share",
    "loss",
    "kl",
    "entropy",
    "grad_norm",
    "learning_rate",
    "completion_length",
    "wall_time",
)
_LOGGED_NONE: float = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0001))[0]


def _encode(values: Mapping[str, float | None], series_names: Sequence[str]) -> bytes | None:
    if not values:
        return None
    out = [math.nan] * len(series_names)
    for i, name in enumerate(series_names):
        if name in values:
            value = values[name]
            out[i] = value if value is not None and math.isfinite(value) else _LOGGED_NONE
    return _pack_doubles(out)


def _decode(data: bytes | None, n_names: int) -> list[float | None]:
    values: list[float | None] = [None if v != v else v for v in _unpack("d", data)]
    return (values + [None] * n_names)[:n_names]


def _step_rows(
    conn: sa.Connection, *, run_id: int, after: int, through: int | None, n_series: int
) -> list[tuple[int, list[float | None]]]:
    """(step, values in layout order) of steps in (after, through]."""
    columns = ", ".join(STEP_SERIES)
    bound = " AND step <= :t" if through is not None else ""
    rows = conn.execute(
        sa.text(
            f"SELECT step, {columns}, series FROM steps WHERE run_id = :r AND step > :a{bound}"
            " ORDER BY step"
        ),
        {"r": run_id, "a": after, "t": through},
    )
    n = len(STEP_SERIES)
    return [(row[0], [*row[1 : 1 + n], *_decode(row[1 + n], n_series)]) for row in rows]


# --- frozen: rollups (server/store/rollups.py, server.store.models.ROLLUP_WIDTHS) ---------------------

ROLLUP_WIDTHS = (10, 25, 100, 1000)
FIELDS = 6  # per series: n, total, lo, hi, first step, last step


def _aggregate(rows: Iterable[tuple[int, Sequence[float | None]]], n_names: int) -> list[float]:
    out = [0.0] * (FIELDS * n_names)
    for step, values in rows:
        for i, value in enumerate(values):
            if value is None:
                continue
            at = FIELDS * i
            if out[at] == 0:
                out[at : at + FIELDS] = [1.0, value, value, value, step, step]
                continue
            out[at] += 1
            out[at + 1] += value
            out[at + 2] = min(out[at + 2], value)
            out[at + 3] = max(out[at + 3], value)
            out[at + 5] = step
    return out


def _merge(into: list[float], part: Sequence[float]) -> None:
    for at in range(0, min(len(into), len(part)), FIELDS):
        n = part[at]
        if n == 0:
            continue
        if into[at] == 0:
            into[at : at + FIELDS] = part[at : at + FIELDS]
            continue
        into[at] += n
        into[at + 1] += part[at + 1]
        into[at + 2] = min(into[at + 2], part[at + 2])
        into[at + 3] = max(into[at + 3], part[at + 3])
        into[at + 4] = min(into[at + 4], part[at + 4])
        into[at + 5] = max(into[at + 5], part[at + 5])


def _roll(conn: sa.Connection, *, run_id: int, width: int, first: int, last: int, n_series: int) -> None:
    """Buckets first..last of `width`: the smallest width from its steps, each wider one by
    merging the next smaller width that divides it (rolled first)."""
    n_names = len(STEP_SERIES) + n_series
    smaller = max((w for w in ROLLUP_WIDTHS if w < width and width % w == 0), default=None)
    by_bucket: dict[int, list[float]] = {}
    if smaller is None:
        rows = _step_rows(
            conn, run_id=run_id, after=first * width, through=(last + 1) * width, n_series=n_series
        )
        members: dict[int, list[tuple[int, list[float | None]]]] = {}
        for step, values in rows:
            members.setdefault((step - 1) // width, []).append((step, values))
        by_bucket = {b: _aggregate(m, n_names) for b, m in members.items()}
    else:
        ratio = width // smaller
        parts = conn.execute(
            sa.text(
                "SELECT bucket, data FROM rollups WHERE run_id = :r AND width = :w"
                " AND bucket >= :lo AND bucket < :hi"
            ),
            {"r": run_id, "w": smaller, "lo": first * ratio, "hi": (last + 1) * ratio},
        )
        for bucket, data in parts:
            merged = by_bucket.setdefault(bucket // ratio, [0.0] * (FIELDS * n_names))
            _merge(merged, _unpack("d", data))
    if by_bucket:
        conn.execute(
            sa.text(
                "INSERT INTO rollups (run_id, width, bucket, data) VALUES (:r, :w, :b, :d)"
            ),
            [
                {"r": run_id, "w": width, "b": b, "d": _pack_doubles(flat)}
                for b, flat in sorted(by_bucket.items())
            ],
        )


# --- frozen: the alert rules over a whole history (server/core/alerts.py, server/core/vocab.py) ---------

WINDOW = 25
REWARD, ACCURACY, ZERO_STD = "reward_mean", "true_accuracy", "zero_std_share"
STUCK, SOLVED = "groups/stuck", "groups/solved"
COLLAPSED = "state/collapse"
SPIKE_PROBES = tuple(
    f"probe/{p}/mean"
    for p in ("eot_after_open", "close_after_open", "eot_after_id", "close_after_close", "eot_after_result")
)
DROP_PROBES = tuple(f"probe/{p}/mean" for p in ("open_first", "close_after_id", "eot_after_close"))
READS = (REWARD, ACCURACY, ZERO_STD, STUCK, SOLVED, *SPIKE_PROBES, *DROP_PROBES, COLLAPSED)
COLUMN_INPUTS = (REWARD, ACCURACY, ZERO_STD)  # step columns: an entry every step, None or not
Series = Sequence[tuple[int, float | None]]


@dataclass(frozen=True)
class _Thresholds:
    spike_abs: float = 0.5
    spike_ratio: float = 4.0
    spike_min: float = 0.2
    spike_window: int = 10
    collapse_share: float = 0.5
    hacking_window: int = WINDOW
    hacking_min_rise: float = 0.1
    hacking_max_acc_change: float = 0.0
    drop_below: float = 0.5
    drop_from: float = 0.9
    signal_loss_share: float = 0.95
    signal_loss_window: int = 10
    solved_share: float = 0.8
    solved_window: int = WINDOW
    solved_quiet: int = WINDOW
    groups_per_step: int = 1  # the run's prompts_per_step
    min_groups: int = 4

    @property
    def shares_window(self) -> int:
        return max(1, math.ceil(self.min_groups / max(1, self.groups_per_step)))

    @property
    def groups_window(self) -> int:
        return max(self.signal_loss_window, self.shares_window)

    @property
    def solved_steps(self) -> int:
        return max(self.solved_window, self.shares_window)


@dataclass(frozen=True)
class _Alert:
    kind: str
    step: int
    message: str
    series: str | None = None


def _present(series: Series) -> tuple[list[int], list[float]]:
    pairs = [(s, v) for s, v in series if v is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _episodes(steps: Sequence[int], flags: Sequence[bool], quiet: int = 1) -> list[int]:
    return [
        step
        for i, (step, flag) in enumerate(zip(steps, flags, strict=True))
        if flag and not any(flags[max(0, i - quiet) : i])
    ]


def _rolling_mean(values: Sequence[float | None], window: int) -> list[float | None]:
    out: list[float | None] = []
    recent: list[float] = []
    for value in values:
        if value is not None:
            recent.append(value)
            if len(recent) > window:
                recent.pop(0)
        out.append(sum(recent) / len(recent) if recent else None)
    return out


def _mean(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else 0.0


def _spikes(name: str, series: Series, t: _Thresholds) -> list[_Alert]:
    steps, values = _present(series)
    flags = []
    for i, value in enumerate(values):
        history = values[max(0, i - t.spike_window) : i]
        baseline = sum(history) / len(history) if history else None
        relative = (
            baseline is not None
            and value >= t.spike_min
            and value > t.spike_ratio * max(baseline, 1e-6)
        )
        flags.append(value >= t.spike_abs or relative)
    return [
        _Alert(
            "control_token_spike",
            step,
            f"{name} jumped to {values[steps.index(step)]:.2f} at step {step}",
            series=name,
        )
        for step in _episodes(steps, flags)
    ]


def _drops(name: str, series: Series, t: _Thresholds) -> list[_Alert]:
    steps, values = _present(series)
    flags = []
    for i, value in enumerate(values):
        history = values[max(0, i - t.spike_window) : i]
        flags.append(
            bool(history) and sum(history) / len(history) >= t.drop_from and value < t.drop_below
        )
    return [
        _Alert(
            "control_token_spike",
            step,
            f"{name} fell to {values[steps.index(step)]:.2f} at step {step}: another token took its place",
            series=name,
        )
        for step in _episodes(steps, flags)
    ]


def _collapse(series: Series, t: _Thresholds) -> list[_Alert]:
    steps, values = _present(series)
    w = t.shares_window
    flags, means = [], []
    for i in range(len(values)):
        if i + 1 < w:
            flags.append(False)
            means.append(0.0)
            continue
        means.append(sum(values[i + 1 - w : i + 1]) / w)
        flags.append(means[-1] >= t.collapse_share)
    over = f" over the last {w} steps" if w > 1 else ""
    return [
        _Alert(
            "collapse",
            step,
            f"{means[steps.index(step)]:.0%} of completions collapsed{over} at step {step}",
            series=COLLAPSED,
        )
        for step in _episodes(steps, flags)
    ]


def _reward_hacking(reward: Series, accuracy: Series, t: _Thresholds) -> list[_Alert]:
    acc_by_step = dict(accuracy)
    pairs = [
        (s, r, acc_by_step.get(s))
        for s, r in reward
        if r is not None and acc_by_step.get(s) is not None
    ]
    w = t.hacking_window
    steps, flags = [], []
    for i in range(len(pairs)):
        steps.append(pairs[i][0])
        if i + 1 < 2 * w:
            flags.append(False)
            continue
        before, after = pairs[i + 1 - 2 * w : i + 1 - w], pairs[i + 1 - w : i + 1]
        d_reward = _mean([p[1] for p in after]) - _mean([p[1] for p in before])
        d_acc = _mean([p[2] for p in after]) - _mean([p[2] for p in before])
        flags.append(d_reward >= t.hacking_min_rise and d_acc <= t.hacking_max_acc_change)
    return [
        _Alert(
            "reward_hacking",
            step,
            f"verifier reward rose over the last {w} steps while true accuracy did not (step {step})",
            series=REWARD,
        )
        for step in _episodes(steps, flags)
    ]


def _group_share(share: Series, limit: float, window: int) -> tuple[list[int], list[bool]]:
    steps = [s for s, v in share]
    smoothed = _rolling_mean([v for _, v in share], window)
    flags = [
        i + 1 >= window and m is not None and m >= limit - 1e-9 for i, m in enumerate(smoothed)
    ]
    return steps, flags


def _signal_loss(share: Series, t: _Thresholds, name: str = STUCK) -> list[_Alert]:
    w = t.groups_window
    steps, flags = _group_share(share, t.signal_loss_share, w)
    what = (
        "were stuck (no reward spread below the top reward)"
        if name == STUCK
        else "had zero reward spread"
    )
    return [
        _Alert(
            "signal_loss",
            step,
            f"{t.signal_loss_share:.0%}+ of groups {what} over {w} steps (step {step})",
            series=name,
        )
        for step in _episodes(steps, flags)
    ]


def _solved(share: Series, t: _Thresholds) -> list[_Alert]:
    w, quiet = t.solved_steps, t.solved_quiet
    steps, flags = _group_share(share, t.solved_share, w)
    return [
        _Alert(
            "solved",
            step,
            f"{t.solved_share:.0%}+ of groups were solved (every rollout at the top reward) over {w} steps: little gradient left (step {step})",
            series=SOLVED,
        )
        for step in _episodes(steps, flags, quiet)
    ]


def _evaluate(series: Mapping[str, Series], t: _Thresholds) -> list[_Alert]:
    """Every alert of a whole history, ordered by step."""
    alerts: list[_Alert] = []
    for name, values in series.items():
        if name in SPIKE_PROBES:
            alerts += _spikes(name, values, t)
        if name in DROP_PROBES:
            alerts += _drops(name, values, t)
    if COLLAPSED in series:
        alerts += _collapse(series[COLLAPSED], t)
    if REWARD in series and ACCURACY in series:
        alerts += _reward_hacking(series[REWARD], series[ACCURACY], t)
    if STUCK in series:
        alerts += _signal_loss(series[STUCK], t)
    elif ZERO_STD in series:
        alerts += _signal_loss(series[ZERO_STD], t, name=ZERO_STD)
    if SOLVED in series:
        alerts += _solved(series[SOLVED], t)
    return sorted(alerts, key=lambda a: (a.step, a.kind))


def _from_history(
    steps: Sequence[tuple[int, Mapping[str, float | None]]],
) -> dict[str, list[tuple[int, float | None]]]:
    out: dict[str, list[tuple[int, float | None]]] = {}
    for step, values in steps:
        for name in READS:
            value = values.get(name)
            if value is None and name not in COLUMN_INPUTS:
                continue
            out.setdefault(name, []).append((step, value))
    return out


def downgrade() -> None:
    raise NotImplementedError("0005 packs series and rollouts; restore a backup to go back")
