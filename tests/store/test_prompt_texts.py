"""Prompts stored compressed (server.store.prompt_texts, migration 0022) on both databases:
every reader gets each prompt back as it was written, a run's prompts are compressed against
one dictionary made from its first ones (found again by a recorder started later), deleting
the runs takes their prompts' words out of the index and their dictionaries with the last of
their prompts, and 0022 packs the prompts written before it (and unpacks them on the way back)
as the store reads them."""

from __future__ import annotations

import random
import re

from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord, StepRecord
from rollout_lens.server.store import prompt_texts, search
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.deletion import delete_run
from rollout_lens.server.store.migrate import downgrade, upgrade
from rollout_lens.server.store.models import PromptDictionaryRow, PromptRow, RunPromptRow
from rollout_lens.server.store.recording import sha256_text
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, TOOLS, make_groups, record_steps, step_record

# Queries past ASCII: CJK, a letter and its combining accent, a non-BMP emoji, right to left
QUERIES = ["計算 17 × 38", "e\u0301té 😀 ǅemal", "Привет мир", "שלום עולם", "straße über"]


def _prompt(rng: random.Random, tools: int) -> str:
    """A tool listing in a chat template: `tools` of TOOLS in a random order, and a query."""
    listed = rng.sample(TOOLS, tools)
    listing = "\n".join(f"- {t}: returns what {t} knows, as JSON" for t in listed)
    query = f"{rng.choice(QUERIES)} #{rng.randrange(10**6)}"
    return f"<|system|>You can call these tools:\n{listing}<|user|>{query}<|assistant|>"


def _steps(rng: random.Random, steps: range, *, groups: int, tools: int) -> list[StepRecord]:
    """Steps of `groups` groups of 2, each group a prompt of its own listing `tools` tools."""
    out = []
    for step in steps:
        rollouts: list[RolloutRecord] = make_groups(rng, groups=groups, group_size=2)
        prompts = [_prompt(rng, tools) for _ in range(groups)]
        for r in rollouts:
            r.prompt = prompts[r.group]
        out.append(step_record(step, rollouts=rollouts))
    return out


def _run(factory: sessionmaker[Session], steps: list[StepRecord], *, name: str) -> int:
    with session_scope(factory) as session:
        run_id = store.create_run(
            session,
            name=name,
            model="tiny",
            total_steps=len(steps),
            group_size=2,
            control_tokens=CONTROL_TOKENS,
        ).id
    record_steps(factory, run_id, steps)
    return run_id


def _written(steps: list[StepRecord]) -> dict[tuple[int, int, int], str]:
    return {(s.step, r.group, r.index): r.prompt for s in steps for r in s.rollouts}


def _read(factory: sessionmaker[Session], run_id: int) -> dict[tuple[int, int, int], str]:
    with session_scope(factory) as session:
        return {
            (r.step, r.group, r.index): p for r, p in store.iter_rollouts(session, run_id=run_id)
        }


def _dictionaries(factory: sessionmaker[Session], run_id: int) -> list[int | None]:
    """The dictionary of each of the run's prompts."""
    with session_scope(factory) as session:
        return list(
            session.scalars(
                select(PromptRow.dictionary_id)
                .join(RunPromptRow, RunPromptRow.prompt_id == PromptRow.id)
                .where(RunPromptRow.run_id == run_id)
            )
        )


def test_every_reader_gets_each_prompt_back_as_written(
    session_factory: sessionmaker[Session],
) -> None:
    steps = _steps(random.Random(1), range(1, 4), groups=6, tools=48)
    run_id = _run(session_factory, steps, name="listings")
    assert _read(session_factory, run_id) == _written(steps)
    with session_scope(session_factory) as session:
        for step in steps:
            got = store.step_rollouts(session, run_id=run_id, step=step.step)
            assert [p for _, p in got] == [r.prompt for r in step.rollouts]
        rows = session.execute(select(PromptRow.id, PromptRow.sha256, PromptRow.packed)).all()
        texts = prompt_texts.texts(session, [i for i, _, _ in rows])
    assert {sha256_text(t) for t in texts.values()} == {h for _, h, _ in rows}
    # one dictionary for the run, which every later prompt is compressed against
    assert len(set(_dictionaries(session_factory, run_id))) == 1
    assert None not in _dictionaries(session_factory, run_id)
    raw = sum(len(t.encode()) for t in texts.values())
    assert sum(len(packed) for _, _, packed in rows) < raw / 4


def test_a_dictionary_is_cut_at_the_start_of_a_character(
    session_factory: sessionmaker[Session],
) -> None:
    """Prompts of three-byte characters, more than a dictionary holds: it ends at the last
    whole character, and every prompt compressed against it reads back."""
    wide = "語" * (prompt_texts.DICTIONARY_BYTES // 3 + 50)
    assert prompt_texts.dictionary_text([wide]) == "語" * (prompt_texts.DICTIONARY_BYTES // 3)
    rng = random.Random(5)
    steps = _steps(rng, range(1, 3), groups=2, tools=4)
    for step in steps:
        for r in step.rollouts:
            r.prompt = f"{wide}{r.group}{step.step}"
    run_id = _run(session_factory, steps, name="wide")
    assert _read(session_factory, run_id) == _written(steps)
    assert None not in _dictionaries(session_factory, run_id)


def test_a_run_keeps_its_dictionary_across_recorders(
    session_factory: sessionmaker[Session],
) -> None:
    """A recorder built again from the database (a resume, after a rollback) compresses the
    run's new prompts against the dictionary its first write made; another run with prompts
    of its own makes its own; a run whose writes bring few prompt bytes makes none."""
    rng = random.Random(2)
    steps = _steps(rng, range(1, 5), groups=4, tools=40)
    with session_scope(session_factory) as session:
        run_id = store.create_run(
            session, name="resumed", model="tiny", total_steps=4, group_size=2
        ).id
    for step in steps:  # a recorder a step
        with session_scope(session_factory) as session:
            store.record_step(session, run_id=run_id, record=step, control_tokens=CONTROL_TOKENS)
    assert _read(session_factory, run_id) == _written(steps)
    used = _dictionaries(session_factory, run_id)
    assert len(used) == 16 and len(set(used)) == 1 and used[0] is not None
    other = _run(session_factory, _steps(rng, range(1, 3), groups=4, tools=40), name="other")
    assert set(_dictionaries(session_factory, other)).isdisjoint(used)
    short = _steps(rng, range(1, 4), groups=1, tools=2)
    few = _run(session_factory, short, name="few")
    assert set(_dictionaries(session_factory, few)) == {None}
    assert _read(session_factory, few) == _written(short)


def _prompt_hits(factory: sessionmaker[Session], word: str) -> set[int]:
    with session_scope(factory) as session:
        match = search.prompt_match_sql(session.connection(), q=word, column="p.id")
        found = session.execute(text(f"SELECT p.id FROM prompts p WHERE {match.sql}"), match.params)
        return set(found.scalars())


def test_deleting_runs_takes_their_prompts_words_and_dictionaries(
    session_factory: sessionmaker[Session],
) -> None:
    """Two runs share their first steps' prompts (written by the first, with its dictionary):
    deleting the first keeps what the second still uses; deleting the second leaves no
    prompt, no dictionary and none of their words in the prompts' index."""
    steps = _steps(random.Random(3), range(1, 5), groups=4, tools=40)
    first = _run(session_factory, steps, name="first")
    second = _run(session_factory, steps[:2], name="second")
    words = {w for s in steps for r in s.rollouts for w in re.findall(r"[^\W_]+", r.prompt.lower())}
    rare = sorted(w for w in words if w.isdigit() and len(w) > 3)  # each query's own number
    assert rare and all(_prompt_hits(session_factory, w) for w in rare)
    with session_scope(session_factory) as session:
        delete_run(session, run_id=first)
    assert _read(session_factory, second) == _written(steps[:2])
    with session_scope(session_factory) as session:
        assert session.scalar(select(func.count()).select_from(PromptDictionaryRow)) == 1
    with session_scope(session_factory) as session:
        delete_run(session, run_id=second)
    with session_scope(session_factory) as session:
        assert session.scalar(select(func.count()).select_from(PromptRow)) == 0
        assert session.scalar(select(func.count()).select_from(PromptDictionaryRow)) == 0
    assert not any(_prompt_hits(session_factory, w) for w in sorted(words))


def _as_0021(engine: Engine) -> dict[int, str]:
    """prompts.text as 0021 holds it."""
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT id, text FROM prompts")).all())


def test_0022_packs_the_prompts_written_before_it_and_unpacks_them_back(
    engine: Engine, session_factory: sessionmaker[Session]
) -> None:
    """A run the store wrote (dictionary and all) survives 0022's downgrade and upgrade; more
    prompts than one batch (500), written and indexed as 0021's store did, are packed by 0022
    (a dictionary a batch), read back as written and found by their words as before."""
    rng = random.Random(4)
    steps = _steps(rng, range(1, 3), groups=4, tools=40)
    run_id = _run(session_factory, steps, name="before")
    with session_scope(session_factory) as session:
        stored = prompt_texts.texts(session, session.scalars(select(PromptRow.id)).all())
    downgrade(engine, "0021")
    assert _as_0021(engine) == stored
    older = [_prompt(rng, rng.choice([1, 30, 60])) for _ in range(620)]
    older += QUERIES + ["", "x" * 70_000]
    with engine.begin() as conn:
        ids = [
            conn.execute(
                text("INSERT INTO prompts (sha256, text) VALUES (:h, :t) RETURNING id"),
                {"h": sha256_text(t), "t": t},
            ).scalar_one()
            for t in older
        ]
        search.index_prompts(conn, list(zip(ids, older, strict=True)))
    engine.dispose()  # no pooled connection keeps prompts' old row type
    upgrade(engine)
    with session_scope(session_factory) as session:
        after = prompt_texts.texts(session, session.scalars(select(PromptRow.id)).all())
        dictionaries = session.scalar(select(func.count()).select_from(PromptDictionaryRow))
    assert after == stored | dict(zip(ids, older, strict=True))
    assert dictionaries == 2  # one a batch of 500 (the run's went with the downgrade)
    assert _read(session_factory, run_id) == _written(steps)
    number = re.search(r"#(\d+)", older[0])
    assert number and _prompt_hits(session_factory, number.group(1)) == {
        i for i, t in after.items() if number.group(1) in re.findall(r"\d+", t)
    }
    assert _prompt_hits(session_factory, "мир") == {i for i, t in after.items() if "мир" in t}
    downgrade(engine, "0021")
    assert _as_0021(engine) == after
    engine.dispose()
    upgrade(engine)
    assert _prompt_hits(session_factory, "мир") == {i for i, t in after.items() if "мир" in t}
