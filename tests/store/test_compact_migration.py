"""Migration 0005 on a database the previous schema wrote (tests/fixtures/schema_0004.db.gz: a
real 12-step leaky run of the tiny model with off-policy supervision and evaluations, and a
40-step synthetic leaky run written by bench.pages): every rollout, array, meta key, token text
and series value survives the move to the compact layout."""

from __future__ import annotations

import gzip
import json
import re
import sqlite3
from array import array
from pathlib import Path

import pytest
from rollout_lens.server import store
from rollout_lens.server.store import arrays
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import current_revision, head_revision, upgrade
from rollout_lens.server.store.serialize import rollout_dict
from rollout_lens.server.webapp import queries

FIXTURE = Path(__file__).parents[1] / "fixtures" / "schema_0004.db.gz"


def _before(path: Path) -> tuple[dict, dict, dict]:
    """What the old schema holds, read with plain sqlite3."""
    conn = sqlite3.connect(path)
    rollouts = {}
    for row in conn.execute(
        'SELECT r.run_id, r.step, r."group", r.idx, r.completion, r.completion_ids,'
        " r.token_logprobs, r.control_probs, r.meta, p.text FROM rollouts r"
        " JOIN prompts p ON p.id = r.prompt_id"
    ):
        run_id, step, group, idx, completion, ids, logprobs, control, meta, prompt = row
        rollouts[(run_id, step, group, idx)] = {
            "completion": completion,
            "prompt": prompt,
            "ids": array("i", ids).tolist(),
            "logprobs": array("f", logprobs).tolist(),
            "control": array("f", control).tolist(),
            "meta": json.loads(meta),
        }
    metrics: dict = {}
    for run_id, step, name, value in conn.execute("SELECT run_id, step, name, value FROM metrics"):
        metrics.setdefault(run_id, {}).setdefault(name, []).append((step, value))
    steps = dict(conn.execute("SELECT run_id, count(*) FROM steps GROUP BY run_id").fetchall())
    conn.close()
    return rollouts, {r: dict(sorted(m.items())) for r, m in metrics.items()}, steps


def _words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[^\W_]+", text)}


def test_compact_migration_keeps_every_rollout_and_series(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    path.write_bytes(gzip.decompress(FIXTURE.read_bytes()))
    with sqlite3.connect(path) as conn:  # a series logged without a value (NaN became NULL)
        conn.execute(
            "INSERT INTO metrics (run_id, step, name, value) VALUES (2, 3, 'custom/nan', NULL)"
        )
        # series that fire the alert rules the migration carries (a spike, a drop, a collapse,
        # stuck then solved groups), so its alerts are compared with the rules' on something
        conn.executemany(
            "INSERT INTO metrics (run_id, step, name, value) VALUES (2, ?, ?, ?) "
            "ON CONFLICT (run_id, name, step) DO UPDATE SET value = excluded.value",
            [
                (step, name, value)
                for step in range(1, 41)
                for name, value in (
                    ("probe/eot_after_open/mean", 0.9 if step == 21 else 0.01),
                    ("probe/open_first/mean", 0.1 if step == 25 else 0.99),
                    ("state/collapse", 0.9 if 12 <= step <= 16 else 0.0),
                    ("groups/stuck", 1.0 if step <= 12 else 0.0),
                    ("groups/solved", 0.0 if step <= 12 else 1.0),
                )
            ],
        )
    rollouts, metrics, step_counts = _before(path)
    assert metrics[2]["custom/nan"] == [(3, None)]
    assert len(rollouts) == 416 and set(step_counts) == {1, 2}

    engine = make_engine(f"sqlite:///{path}")
    assert current_revision(engine) == "0004"
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    factory = make_session_factory(engine)
    seen = 0
    with session_scope(factory) as session:
        for run_id in (1, 2):
            run = store.get_run(session, run_id=run_id)
            tokens = list(run.control_tokens)
            texts = store.token_texts(session, run_id=run_id)
            for rollout, prompt in store.iter_rollouts(session, run_id=run_id):
                old = rollouts[(run_id, rollout.step, rollout.group, rollout.index)]
                new = rollout_dict(rollout, prompt, tokens, texts)
                seen += 1
                assert new["completion"] == old["completion"]
                assert new["completion_ids"] == old["ids"]
                assert new["tokens"] == old["meta"]["tokens"]
                assert new["meta"] == {k: v for k, v in old["meta"].items() if k != "tokens"}
                # float16 (0005: half a unit in the last place), then 1/LOGPROB_SCALE nat (0006)
                half_step = 0.5 / arrays.LOGPROB_SCALE
                assert len(new["token_logprobs"]) == len(old["logprobs"])
                for got, was in zip(new["token_logprobs"], old["logprobs"], strict=True):
                    assert abs(got - was) <= half_step + abs(was) * 2**-11 + 1e-7
                # control-token probabilities below the floor are not stored (0006)
                flat = [p for t in tokens for p in new["control_token_probs"][t]]
                kept = [p if p >= arrays.CONTROL_FLOOR else 0.0 for p in old["control"]]
                assert flat == pytest.approx(kept, rel=1e-3, abs=1e-4)
            assert len(store.steps(session, run_id=run_id)) == step_counts[run_id]
            assert store.metric_series(session, run_id=run_id) == metrics[run_id]
            # alerts were evaluated for the whole history, as a from-scratch evaluation says
            assert run.alerts_through == run.current_step
            stored = queries.alerts(session, run_id=run_id)
            if run_id == 2:
                kinds = {a["kind"] for a in stored}
                assert kinds >= {"control_token_spike", "collapse", "signal_loss", "solved"}
            assert stored == [
                a.as_dict() for a in queries.evaluate_alerts(session, run_id=run_id, after=0)
            ]
            # 0006 indexed every completion and prompt: search finds what a scan of them finds
            mine = {k: v for k, v in rollouts.items() if k[0] == run_id}
            word = next(w for v in mine.values() for w in re.findall(r"[^\W_]+", v["completion"]))
            query = queries.RolloutQuery(q=word, limit=200)
            found = queries.explore(session, run_id=run_id, query=query)
            rows = found["rollouts"]
            while found["next"]:
                query = query.model_copy(update={"after": found["next"]})
                found = queries.explore(session, run_id=run_id, query=query)
                rows += found["rollouts"]
            expected = {
                k[1:]
                for k, v in mine.items()
                if word.lower() in _words(v["completion"]) or word.lower() in _words(v["prompt"])
            }
            assert {(r["step"], r["group"], r["index"]) for r in rows} == expected
            assert found["total"] == len(expected) > 0
    assert seen == len(rollouts)
    # Facts are shared: far fewer rows than rollouts, and tool listings are no longer repeated.
    conn = sqlite3.connect(path)
    facts = conn.execute("SELECT count(*) FROM facts").fetchone()[0]
    assert 0 < facts <= 52  # at most one per group (52 steps of one group each)
    conn.close()
    engine.dispose()
