"""Reads that must stay bounded: the runs list a page at a time, and compare's charts and
summary (on a real SQLite file and on PostgreSQL)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.store import deletion
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunStatus
from rollout_lens.server.webapp import queries
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import (
    CONTROL_TOKENS,
    make_rollouts,
    make_run,
    record_step,
    record_steps,
    step_record,
)
from tests.sql_support import executed
from tests.web_support import parse


def _runs(factory: sessionmaker[Session], count: int, *, queued_every: int = 3) -> list[int]:
    """`count` runs named run 0, run 1, …; every `queued_every`-th queued, the rest completed."""
    ids = []
    with session_scope(factory) as session:
        for i in range(count):
            status = RunStatus.queued if i % queued_every == 0 else RunStatus.completed
            ids.append(
                store.create_run(
                    session,
                    name=f"run {i}",
                    model="tiny",
                    total_steps=10,
                    group_size=8,
                    seed=i,
                    control_tokens=CONTROL_TOKENS,
                    status=status,
                ).id
            )
    return ids


def _page(factory: sessionmaker[Session], **kwargs: object) -> dict:
    with session_scope(factory) as session:
        return queries.runs_page(session, **kwargs)  # type: ignore[arg-type]


def test_runs_page_pages_through_sorted_runs(session_factory) -> None:
    ids = _runs(session_factory, 7)
    first = _page(session_factory, per_page=3)
    assert [r["id"] for r in first["runs"]] == ids[::-1][:3]  # newest first
    assert (first["total"], first["pages"], first["first"], first["last"]) == (7, 3, 1, 3)
    assert first["newest"] == ids[-1]
    last = _page(session_factory, per_page=3, page=3)
    assert [r["id"] for r in last["runs"]] == [ids[0]] and (last["first"], last["last"]) == (7, 7)
    past = _page(session_factory, per_page=3, page=4)
    assert past["runs"] == [] and past["total"] == 7 and past["first"] is None
    # Queue places are the run's place in the whole queue, not on its page.
    assert last["runs"][0]["queue_position"] == 1 and last["runs"][0]["text"]["queue_position"]
    by_name = _page(session_factory, sort="name", descending=False, per_page=2, page=2)
    assert [r["name"] for r in by_name["runs"]] == ["run 2", "run 3"]
    assert _page(session_factory, q="run 4")["total"] == 1
    # Summary columns sort the list; runs without them come last either way.
    for run_id, acc in ((ids[1], 0.9), (ids[2], 0.2)):
        record_step(session_factory, run_id, 1, values={"true_accuracy": acc})
    for descending, top in ((True, ids[1]), (False, ids[2])):
        page = _page(session_factory, sort="accuracy", descending=descending, per_page=3)
        assert page["runs"][0]["id"] == top and page["runs"][2]["recent_true_accuracy"] is None
    # A live page's poll: its runs, plus any newer than the newest it knows.
    polled = _page(session_factory, ids=[ids[0], ids[1]], after=ids[5], per_page=2)
    assert [r["id"] for r in polled["runs"]] == [ids[6], ids[1]] and polled["total"] == 3
    for bad in ({"per_page": 0}, {"per_page": 201}, {"page": 0}, {"sort": "nope"}):
        with pytest.raises(InvalidInput):
            _page(session_factory, **bad)


def test_runs_page_reads_the_same_statements_for_many_runs(engine, session_factory) -> None:
    _runs(session_factory, 4)
    with executed(engine) as few:
        _page(session_factory)
    _runs(session_factory, 120)
    with executed(engine) as many:
        page = _page(session_factory, page=2, sort="progress")
    assert len(page["runs"]) == 50 and page["total"] == 124
    # the count with the newest id, the page's rows, the queue, the warnings: nothing per run
    assert len(few) == len(many) == 4


def _ramp(factory: sessionmaker[Session], steps: int, seed: int, name: str) -> int:
    """A run whose true accuracy is 0 for 30 steps, then 1; reward 0.123456789 throughout."""
    with session_scope(factory) as session:
        run_id = store.create_run(
            session,
            name=name,
            model="tiny",
            total_steps=steps,
            group_size=8,
            seed=seed,
            control_tokens=CONTROL_TOKENS,
            status=RunStatus.completed,
        ).id

    def records() -> Iterator[StepRecord]:
        for step in range(1, steps + 1):
            acc = 0.0 if step <= 30 else 1.0
            values = {"true_accuracy": acc, "reward_mean": 0.123456789, "vote_agreement": acc}
            metrics = {"ctrl/<tool>/mean": 0.00123456789 * step}
            yield step_record(step, values=values, metrics=metrics)

    record_steps(factory, run_id, records())
    return run_id


def test_compare_charts_are_bounded_and_its_summary_comes_from_buckets(session_factory) -> None:
    ids = [_ramp(session_factory, 130, seed, f"ramp {seed}") for seed in range(4)]
    with session_scope(session_factory) as session:
        pair = queries.compare(session, run_ids=ids[:2], max_points=60)
        four = queries.compare(session, run_ids=ids)
    first = pair["series"][str(ids[0])]
    assert first["bucket"] == 10 and pair["bands"] is True  # 130 steps in 60 points: rollups
    reward = first["series"]["reward_mean"]
    assert reward["x"] == list(range(1, 131, 10)) and set(reward) == {"x", "y", "lo", "hi"}
    assert set(reward["y"]) == {0.1235}  # four significant digits: what a chart shows
    assert first["series"]["ctrl/<tool>/mean"]["y"][0] == pytest.approx(0.0068, abs=1e-9)
    # Four runs: each gets 1,200 / 4 points (all 130 steps here), means without bands.
    assert four["points"] == 300 and four["bands"] is False
    accuracy = four["series"][str(ids[3])]["series"]["true_accuracy"]
    assert set(accuracy) == {"x", "y"} and accuracy["x"] == list(range(1, 131))
    summary = four["summary"][0]
    assert summary["converged_at"] == 75  # steps 51–75: the first bucket whose mean is ≥ 0.9
    assert summary["stability"] == 0.0 and summary["final_accuracy"] == 1.0
    assert summary["final_reward"] == pytest.approx(0.123456789)
    assert summary["steps"] == 130


def test_runs_page_and_api_link_their_pages(session_factory, client) -> None:
    ids = _runs(session_factory, 7)
    html = parse(client.get("/?per_page=3&page=2").text)
    rows = html.by_id("runs-table").find("tbody").find_all("tr")
    assert [int(r.attrs["data-run-id"]) for r in rows] == ids[::-1][3:6]
    assert html.by_id("showing").text == "Showing 4–6 of 7"
    assert html.by_id("run-count").text == "7"
    pager = html.find("nav", cls="pager")
    links = {a.attrs["rel"]: a.attrs["href"] for a in pager.find_all("a")}
    assert links == {
        "prev": "/?sort=created&order=desc&page=1&per_page=3",
        "next": "/?sort=created&order=desc&page=3&per_page=3",
    }
    past = parse(client.get("/?per_page=3&page=9").text).by_id("past-the-end")
    assert "No runs on page 9" in past.text and past.find("a").attrs["href"].endswith(
        "page=3&per_page=3"
    )
    # The JSON twin: the same page, and links to follow through every run.
    seen, url = [], "/api/runs?q=run&per_page=3"
    while url:
        body = client.get(url).json()
        seen += [r["id"] for r in body["runs"]]
        url = body["links"]["next"]
    assert (
        seen == ids[::-1]
        and body["total"] == 7
        and body["links"]["prev"].endswith("page=2&per_page=3")
    )
    for bad in ("per_page=0", "per_page=201", "page=0", "page=x"):
        response = client.get(f"/api/runs?{bad}")
        assert response.status_code == 422 and response.json()["detail"], bad
        assert client.get(f"/?{bad}").status_code == 422, bad


def test_compare_keeps_each_runs_part_until_the_run_changes(session_factory, client) -> None:
    a, b = (_ramp(session_factory, 40, seed, f"kept {seed}") for seed in range(2))
    first = client.get(f"/api/compare?runs={a},{b}").json()
    again = client.get(f"/api/compare?runs={a},{b}").json()  # the runs' parts from memory
    assert again == first and first["summary"][0]["steps"] == 40
    record_step(session_factory, a, 41, values={"true_accuracy": 1.0, "reward_mean": 1.0})
    moved = client.get(f"/api/compare?runs={a},{b}").json()
    assert moved["summary"][0]["steps"] == 41 and moved["summary"][1] == first["summary"][1]
    assert moved["series"][str(a)]["series"]["reward_mean"]["x"][-1] == 41
    page = parse(client.get(f"/compare?runs={a},{b}").text).json("page-data")
    assert page["series"] == moved["series"]


def _run_with_tokens(factory: sessionmaker[Session], name: str, pieces: list[str]) -> int:
    """A run whose one rollout's tokens are `pieces` (ids 0, 1, …), their texts recorded."""
    run_id = make_run(factory, steps=0, group_size=1, name=name)
    (rollout,) = make_rollouts(random.Random(0), group_size=1, completion="".join(pieces))
    rollout.completion_ids, rollout.tokens = list(range(len(pieces))), pieces
    rollout.token_logprobs, rollout.control_probs = [], {}
    record_step(factory, run_id, 1, rollouts=[rollout])
    return run_id


def _texts(
    engine: Engine,
    factory: sessionmaker[Session],
    cache: store.TokenTextCache,
    run_id: int,
    ids: set[int],
) -> tuple[dict[int, str], int]:
    """The cache's texts of these ids, and how many statements read run_tokens for them."""
    with executed(engine) as ran, session_scope(factory) as session:
        texts = cache.texts(session, store.get_run(session, run_id=run_id), ids)
    return texts, sum("run_tokens" in statement for statement, _ in ran)


def test_a_runs_token_texts_are_read_once(engine, session_factory) -> None:
    """The web app's TokenTextCache reads each text of a run once and gives what token_texts
    gives; a run given a deleted run's id (SQLite reuses the highest) is not served the old
    run's texts; ids with no text are asked again."""
    cache = store.TokenTextCache()
    first = _run_with_tokens(session_factory, "first", ["Hel", "lo", " wor", "ld"])
    assert _texts(engine, session_factory, cache, first, {0, 1}) == ({0: "Hel", 1: "lo"}, 1)
    assert _texts(engine, session_factory, cache, first, {1, 0}) == ({0: "Hel", 1: "lo"}, 0)
    with session_scope(session_factory) as session:
        expected = store.token_texts(session, run_id=first, ids={0, 1, 2, 3, 9})
    assert _texts(engine, session_factory, cache, first, {0, 1, 2, 3, 9}) == (expected, 1)
    assert _texts(engine, session_factory, cache, first, {2, 9}) == ({2: " wor"}, 1)  # 9 asked
    assert _texts(engine, session_factory, cache, first, {3}) == ({3: "ld"}, 0)
    with session_scope(session_factory) as session:
        deletion.delete_run(session, run_id=first)
    second = _run_with_tokens(session_factory, "second", ["¡Ho", "la", "!"])
    if engine.dialect.name == "sqlite":
        assert second == first  # the id is reused
    assert _texts(engine, session_factory, cache, second, {0, 1, 2}) == (
        {0: "¡Ho", 1: "la", 2: "!"},
        1,
    )


def test_the_token_text_cache_keeps_at_most_its_limit(engine, session_factory) -> None:
    """Past its limit the cache drops the runs read least recently; a run with more texts than
    the limit is read each time, never kept in part."""
    cache = store.TokenTextCache(limit=5)
    runs = [_run_with_tokens(session_factory, f"run {i}", ["a", "b", "c"]) for i in range(3)]
    for run_id in runs[:2]:
        assert _texts(engine, session_factory, cache, run_id, {0, 1})[1] == 1
    assert len(cache) == 4
    assert _texts(engine, session_factory, cache, runs[0], {0, 1})[1] == 0  # now the newest
    assert _texts(engine, session_factory, cache, runs[2], {0, 1, 2})[1] == 1
    assert len(cache) == 5  # runs[1] dropped, the least recently read
    assert _texts(engine, session_factory, cache, runs[0], {0, 1})[1] == 0
    assert _texts(engine, session_factory, cache, runs[1], {0, 1})[1] == 1
    for small in (store.TokenTextCache(limit=2), store.TokenTextCache(limit=0)):  # 0: off
        for _ in range(2):
            texts, reads = _texts(engine, session_factory, small, runs[0], {0, 1, 2})
            assert (texts, reads, len(small)) == ({0: "a", 1: "b", 2: "c"}, 1, 0)
        assert not small._runs  # nothing kept for the run, not even an empty entry
