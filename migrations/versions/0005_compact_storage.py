"""compact storage: packed per-step series, packed rollups, facts once per group, token texts
once per run, float16 token arrays, alerts written with their step, retention

Moves every existing run to the new layout without losing a rollout: metric rows become each
step's packed `series`; rollouts' meta is split into shared facts and their own keys, its token
texts go to run_tokens; float32 logprobs and control-token probabilities become float16;
rollups and alerts are computed from the steps (with the same code the recorder uses).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 10:10:00
"""

import json
from collections.abc import Sequence

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
    from rollout_lens.server.store import layout

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
        {"s": layout.encode(values, names), "r": run_id, "step": step}
        for step, values in by_step.items()
    ]
    for start in range(0, len(updates), BATCH):
        conn.execute(
            sa.text("UPDATE steps SET series = :s WHERE run_id = :r AND step = :step"),
            updates[start : start + BATCH],
        )


def _move_rollouts(conn: sa.Connection, run_id: int) -> None:
    """Meta → facts (what the group shares) and own keys; token texts → run_tokens; float32 →
    float16 arrays. The same split the recorder makes (server.store.recording)."""
    from rollout_lens.server.packing import pack_halves, unpack_floats
    from rollout_lens.server.packing import unpack_ints
    from rollout_lens.server.store.recording import canonical_json, sha256_text

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
            token_ids = unpack_ints(ids)
            if isinstance(texts, list) and len(texts) == len(token_ids):
                for token_id, text in zip(token_ids, texts):
                    tokens.setdefault(token_id, str(text))
            groups.setdefault((step, group), []).append((rid, meta))
            arrays[rid] = (pack_halves(unpack_floats(logprobs)), pack_halves(unpack_floats(control)))
        updates = []
        for members in groups.values():
            # A group split across two batches shares less; nothing is lost either way.
            metas = [m for _, m in members]
            keys = set().union(*metas)
            shared = {
                k for k in keys if all(k in m for m in metas) and len({canonical_json(m[k]) for m in metas}) == 1
            }
            for rid, meta in members:
                facts = {k: v for k, v in meta.items() if k in shared}
                own = {k: v for k, v in meta.items() if k not in shared}
                facts_id = None
                if facts:
                    digest = sha256_text(canonical_json(facts))
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
    from rollout_lens.server import alerts as rules
    from rollout_lens.server.models import ROLLUP_WIDTHS
    from rollout_lens.server.store import layout, rollups

    names = json.loads(
        conn.execute(sa.text("SELECT series_names FROM runs WHERE id = :r"), {"r": run_id}).scalar()
        or "[]"
    )
    last = conn.execute(
        sa.text("SELECT max(step) FROM steps WHERE run_id = :r"), {"r": run_id}
    ).scalar()
    if last is None:
        return
    for width in ROLLUP_WIDTHS:
        finished = (last - 1) // width - 1
        if finished >= 0:
            rollups.roll(conn, run_id=run_id, width=width, first=0, last=finished, n_series=len(names))
    layout_names = layout.all_names(names)
    history = [
        (step, dict(zip(layout_names, values)))
        for step, values in rollups.step_rows(conn, run_id=run_id, after=0, through=None, n_series=len(names))
    ]
    per_step = conn.execute(
        sa.text("SELECT prompts_per_step FROM runs WHERE id = :r"), {"r": run_id}
    ).scalar()
    thresholds = rules.AlertThresholds().for_run(per_step)
    found = rules.evaluate(rules.from_history(history), thresholds)
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


def downgrade() -> None:
    raise NotImplementedError("0005 packs series and rollouts; restore a backup to go back")
