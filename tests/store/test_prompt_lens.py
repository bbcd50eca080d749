"""The prompt lens's figures against a brute-force oracle over the rollouts, on both databases:
a run of known per-prompt schedules as written, after a resume's truncation, after an export and
its import, a group written in two batches, a step written out of order, the migration's
backfill, and a deletion."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput, NotFound
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.exchange import export, importer
from rollout_lens.server.store import deletion
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.migrate import downgrade, upgrade
from rollout_lens.server.store.models import PromptGroupRow, RunPromptRow
from rollout_lens.server.webapp import queries
from rollout_lens.server.webapp.queries import prompts as lens
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS
from tests.prompt_lens_support import (
    SCHEDULES,
    SYSTEM,
    all_pages,
    assert_matches_oracle,
    chatml,
    looks,
    oracle,
    schedule_rollouts,
    schedule_run,
)


def test_every_figure_equals_the_brute_force_one(session_factory: sessionmaker[Session]) -> None:
    run_id = schedule_run(session_factory)
    want = assert_matches_oracle(session_factory, run_id)
    by_name = {p["history"][0]["rollout_ids"][0]: p for p in want.values()}
    assert len(by_name) == len(SCHEDULES)
    # the schedules say what each prompt must be (the oracle is not fooling itself)
    with session_scope(session_factory) as session:
        rows = lens.prompts_page(session, run_id=run_id, query=lens.PromptQuery(limit=50))
    named = {p["label"].split()[2]: p for p in rows["prompts"]}
    assert named["learned"]["solved_at"] == 6 and named["learned"]["flips"] == 1
    assert not named["learned"]["forgotten"]
    assert named["alternating"]["flips"] >= 10
    assert named["never"]["solved_at"] is None and named["never"]["zero_spread_share"] == 0
    assert named["always"]["zero_spread_share"] == 1 and named["always"]["last_failed"] is None
    assert named["forgotten"]["forgotten"] and named["forgotten"]["solved_at"] == 1
    assert named["tie"]["solved_at"] is None  # half is no majority
    assert named["unknown"]["true_mean"] is None and named["unknown"]["state"] is None


def test_figures_are_current_after_every_step(session_factory: sessionmaker[Session]) -> None:
    """Read between the steps of a recording, as a page open on a live run: every figure equals
    the oracle's over the rollouts written so far."""
    checked: list[int] = []

    def check(run_id: int, step: int) -> None:
        want = assert_matches_oracle(session_factory, run_id)
        assert max(p["last_step"] for p in want.values()) == step
        checked.append(step)

    schedule_run(session_factory, steps=6, after_step=check)
    assert checked == [1, 2, 3, 4, 5, 6]


def test_what_tells_a_prompt_apart(session_factory: sessionmaker[Session]) -> None:
    """The query its rollouts name; else its last user turn; else (no chat template) what
    follows the lines every prompt of the run starts with."""
    by_query = schedule_run(session_factory, steps=2)
    by_turn = schedule_run(session_factory, steps=2, query_meta=False)
    plain = schedule_run(
        session_factory, steps=2, query_meta=False, render=lambda user: f"{SYSTEM}\nTools\n{user}"
    )
    names = sorted(SCHEDULES)
    for run_id, label in (
        (by_query, "what does {} need?"),
        (by_turn, "Query: what does {} need?\nReply with <tool>ID</tool>."),
        (plain, "…Query: what does {} need?\nReply with <tool>ID</tool>."),
    ):
        rows = all_pages(session_factory, run_id, sort="label")
        assert [r["label"] for r in rows] == sorted(label.format(n) for n in names), run_id
        for r in rows:
            assert SYSTEM in r["text"] and SYSTEM not in r["label"]  # the whole text beside it


@pytest.mark.parametrize("look", sorted(lens.LOOKS))
def test_each_look_selects_the_oracles_prompts(
    session_factory: sessionmaker[Session], look: str
) -> None:
    run_id = schedule_run(session_factory)
    want = {i for i, p in oracle(session_factory, run_id).items() if look in looks(p)}
    got = {p["prompt_id"] for p in all_pages(session_factory, run_id, look=look)}
    assert got == want and want  # each look holds a prompt of the schedules


def test_each_sort_pages_in_the_oracles_order(session_factory: sessionmaker[Session]) -> None:
    run_id = schedule_run(session_factory)
    want = oracle(session_factory, run_id)
    for sort in lens.SORTS:
        for order in ("asc", "desc"):
            got = [
                p["prompt_id"] for p in all_pages(session_factory, run_id, sort=sort, order=order)
            ]
            name = {"prompt": None, "label": None}.get(sort, sort)
            if name is None:
                continue  # by id or label: checked below
            known = sorted(
                (i for i in want if want[i][name] is not None),
                key=lambda i: (want[i][name], i),
                reverse=order == "desc",
            )
            unknown = sorted((i for i in want if want[i][name] is None), reverse=order == "desc")
            expected = unknown + known if order == "asc" else known + unknown
            assert got == expected, (sort, order)
    ids = [p["prompt_id"] for p in all_pages(session_factory, run_id, sort="prompt")]
    assert ids == sorted(want)


def test_search_and_bad_input(session_factory: sessionmaker[Session]) -> None:
    run_id = schedule_run(session_factory, steps=4)
    got = all_pages(session_factory, run_id, q="alternating")
    assert [p["label"] for p in got] == ["what does alternating need?"]
    assert all_pages(session_factory, run_id, q="altern*") == got
    assert all_pages(session_factory, run_id, q="nowhere") == []
    with session_scope(session_factory) as session:
        page = lens.prompts_page(session, run_id=run_id, query=lens.PromptQuery(limit=1))
        with pytest.raises(InvalidInput, match="another sort"):
            lens.prompts_page(
                session,
                run_id=run_id,
                query=lens.PromptQuery(limit=1, sort="flips", after=page["next"]),
            )
        with pytest.raises(InvalidInput, match="other filters"):
            lens.prompts_page(
                session,
                run_id=run_id,
                query=lens.PromptQuery(limit=1, look="solved", after=page["next"]),
            )
        with pytest.raises(InvalidInput, match="not a cursor"):
            lens.prompts_page(session, run_id=run_id, query=lens.PromptQuery(after="garbage"))
        with pytest.raises(NotFound, match="run 999 does not exist"):
            lens.prompts_page(session, run_id=999, query=lens.PromptQuery())
        with pytest.raises(NotFound, match=f"run {run_id} has no prompt 999"):
            queries.prompt_history(session, run_id=run_id, prompt_id=999)
        with pytest.raises(InvalidInput, match="q:"):
            lens.prompts_page(session, run_id=run_id, query=lens.PromptQuery(q="!!"))
        with pytest.raises(InvalidInput, match="runs:"):
            queries.compare_prompts(session, run_ids=[run_id])
        with pytest.raises(InvalidInput, match="width"):
            queries.heatmap(session, run_id=run_id, query=lens.PromptQuery(), width=0)


def test_a_resume_truncates_the_rollups_too(session_factory: sessionmaker[Session]) -> None:
    run_id = schedule_run(session_factory)
    with session_scope(session_factory) as session:
        store.truncate_after(session, run_id=run_id, step=5)
    want = assert_matches_oracle(session_factory, run_id)
    assert max(p["last_step"] for p in want.values()) == 5
    # and goes on from there as a run that never had those steps
    rng = random.Random(99)
    for step in (6, 7):
        with session_scope(session_factory) as session:
            store.record_step(
                session,
                run_id=run_id,
                record=_record(step, schedule_rollouts(step, rng)),
                control_tokens=CONTROL_TOKENS,
            )
    assert_matches_oracle(session_factory, run_id)


def _record(step: int, rollouts: list[RolloutRecord]) -> StepRecord:
    return StepRecord(step=step, rollout_step=step, values={}, rollouts=rollouts, metrics={})


def test_rollouts_in_batches_and_out_of_order(session_factory: sessionmaker[Session]) -> None:
    """An import's batches split a group between two writes; a step's rollouts written after a
    later step's fold their prompts again."""
    with session_scope(session_factory) as session:
        run_id = store.create_run(
            session,
            name="batches",
            model="m",
            total_steps=9,
            group_size=4,
            control_tokens=CONTROL_TOKENS,
        ).id
    rng = random.Random(3)
    for step in (1, 2, 5):
        rollouts = schedule_rollouts(step, rng)
        with session_scope(session_factory) as session:
            writer = store.RunWriter(run_id, control_tokens=CONTROL_TOKENS)
            cut = len(rollouts) // 2 + 1  # inside a group
            writer.add_rollouts(session, step=step, rollouts=rollouts[:cut])
            writer.add_rollouts(session, step=step, rollouts=rollouts[cut:])
        assert_matches_oracle(session_factory, run_id)
    with session_scope(session_factory) as session:  # a fresh writer: the rest of step 5's group
        store.add_rollouts(
            session,
            run_id=run_id,
            step=3,
            rollouts=schedule_rollouts(3, rng),
            control_tokens=CONTROL_TOKENS,
        )
    assert_matches_oracle(session_factory, run_id)


def test_an_imported_export_has_the_same_prompts(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    source = schedule_run(session_factory)
    with session_scope(session_factory) as session:
        data = b"".join(export.export_chunks(session, run_id=source, fmt="jsonl"))
    path = tmp_path / "export.jsonl"
    path.write_bytes(data)
    copy = importer.import_export(session_factory, path).run_id
    assert copy != source
    want = assert_matches_oracle(session_factory, copy)
    with session_scope(session_factory) as session:
        a = lens.prompts_page(session, run_id=source, query=lens.PromptQuery(limit=50))
        b = lens.prompts_page(session, run_id=copy, query=lens.PromptQuery(limit=50))
    assert a["prompts"] == b["prompts"] and len(want) == len(SCHEDULES)


def _rows(engine: Engine) -> tuple[list[Any], list[Any]]:
    with engine.connect() as conn:
        groups = conn.execute(
            select(PromptGroupRow.__table__).order_by(
                PromptGroupRow.run_id, PromptGroupRow.step, PromptGroupRow.group
            )
        ).all()
        prompts = conn.execute(
            select(RunPromptRow.__table__).order_by(RunPromptRow.run_id, RunPromptRow.prompt_id)
        ).all()
    return [tuple(r) for r in groups], [tuple(r) for r in prompts]


def test_the_migration_backfills_what_the_writer_writes(
    engine: Engine, session_factory: sessionmaker[Session]
) -> None:
    schedule_run(session_factory, steps=55)  # more steps than the backfill reads at once
    schedule_run(session_factory, steps=5, query_meta=False)
    written = _rows(engine)
    assert written[0] and written[1]
    downgrade(engine, "0018")
    upgrade(engine)
    backfilled = _rows(engine)
    assert backfilled[0] == written[0]
    for a, b in zip(backfilled[1], written[1], strict=True):
        assert [pytest.approx(x) if isinstance(x, float) else x for x in a] == list(b)


def test_deleting_a_run_deletes_its_rollups(session_factory: sessionmaker[Session]) -> None:
    run_id = schedule_run(session_factory, steps=3)
    other = schedule_run(session_factory, steps=3)
    with session_scope(session_factory) as session:
        deletion.delete_run(session, run_id=run_id)
    with session_scope(session_factory) as session:
        for model in (PromptGroupRow, RunPromptRow):
            assert not session.scalar(select(func.count()).where(model.run_id == run_id))
            assert session.scalar(select(func.count()).where(model.run_id == other))
    assert_matches_oracle(session_factory, other)


def test_runs_matched_by_query_user_turn_or_text(session_factory: sessionmaker[Session]) -> None:
    """A leaky and a patched run ask the same queries with other tool listings: matched by
    query; the same prompts twice: matched by text; by user turn, neither listing matches."""
    first = schedule_run(session_factory, steps=3)
    again = schedule_run(session_factory, steps=3)
    rng = random.Random(1)
    with session_scope(session_factory) as session:
        other = store.create_run(
            session,
            name="other listing",
            model="m",
            total_steps=3,
            group_size=4,
            control_tokens=CONTROL_TOKENS,
        ).id
    for step in (1, 2, 3):
        rollouts = schedule_rollouts(step, rng)
        for r in rollouts:
            r.prompt = chatml(
                "Tools: tool_09\n" + r.prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            )
        with session_scope(session_factory) as session:
            store.record_step(
                session, run_id=other, record=_record(step, rollouts), control_tokens=CONTROL_TOKENS
            )
    with session_scope(session_factory) as session:
        for runs, match, matched in (
            ([first, again], "exact", len(SCHEDULES)),
            ([first, other], "exact", 0),
            ([first, other], "user", 0),
            ([first, other], "query", len(SCHEDULES)),
            ([first, again, other], "query", len(SCHEDULES)),
        ):
            got = queries.compare_prompts(session, run_ids=runs, match=match, limit=2)
            rows = got["prompts"]
            while got["next"]:
                got = queries.compare_prompts(
                    session, run_ids=runs, match=match, limit=2, after=got["next"]
                )
                rows += got["prompts"]
            assert len(rows) == matched, (runs, match)
            for row in rows:
                labels = {p["label"] for r in row["runs"] for p in r["prompts"]}
                assert labels == {row["label"]}
                assert [r["run_id"] for r in row["runs"]] == runs
        alone = queries.compare_prompts(session, run_ids=[first, other], match="user", every=False)
        assert alone["total"] == 2 * len(SCHEDULES)


def test_the_export_is_the_chat_of_the_selected_prompts(
    session_factory: sessionmaker[Session],
) -> None:
    run_id = schedule_run(session_factory, steps=6)
    want = {i for i, p in oracle(session_factory, run_id).items() if "never_solved" in looks(p)}
    with session_scope(session_factory) as session:
        rows = list(
            lens.export_prompts(session, run_id=run_id, query=lens.PromptQuery(look="never_solved"))
        )
    assert {r["prompt_id"] for r in rows} == want
    for r in rows:
        roles = [m["role"] for m in r["prompt"]]
        assert roles == ["system", "user"]
        assert r["prompt"][1]["content"].startswith("Query: what does ")
        assert r["target"] == "tool_01"
