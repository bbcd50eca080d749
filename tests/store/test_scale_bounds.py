"""Bad input at scale gets a bounded answer: a 50 MB completion, a step of 10,000 rollouts, a
query that matches more rows than are counted. Real SQLite and PostgreSQL, the real write path."""

from __future__ import annotations

import random

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.webapp import queries
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, make_rollouts, make_run, record_step
from tests.web_support import client_for

MB = 1 << 20


def _json_size(response) -> int:  # type: ignore[no-untyped-def]
    assert response.status_code == 200, response.text[:300]
    return len(response.content)


def test_a_50_mb_completion_is_stored_whole_and_answered_in_bounds(
    session_factory: sessionmaker[Session],
) -> None:
    run_id = make_run(session_factory, steps=0)
    rng = random.Random(5)
    rollouts = make_rollouts(rng)
    huge = ("needle " + "word " * (10 * MB))[: 50 * MB]  # 50 MB of text
    n = 20_000
    rollouts[3] = RolloutRecord(
        **{**rollouts[3].__dict__, "completion": huge, "completion_ids": list(range(n))}
        | {"token_logprobs": [-0.1] * n, "control_probs": {t: [0.0] * n for t in CONTROL_TOKENS}}
    )
    record_step(session_factory, run_id, 1, rollouts=rollouts)
    with client_for(session_factory) as client:
        group = client.get(f"/api/runs/{run_id}/steps/1/groups/0?max_tokens=100000")
        everything = client.get(f"/api/runs/{run_id}/steps/1/groups/0?max_tokens=0&limit=32")
        page = client.get(f"/runs/{run_id}/steps/1/groups/0")
        found = client.get(f"/api/runs/{run_id}/rollouts?q=needle")
        beyond = client.get(f"/api/runs/{run_id}/rollouts?q=word&len_min=1000")
        export = client.get(f"/api/runs/{run_id}/export?format=jsonl")
    assert _json_size(group) < 2 * MB and _json_size(everything) < 2 * MB
    big = next(r for r in everything.json()["rollouts"] if r["index"] == 3)
    assert big["completion_chars"] == 50 * MB and len(big["completion"]) < 20_000
    assert page.status_code == 200 and len(page.content) < 2 * MB
    rows = found.json()["rollouts"]
    assert [r["index"] for r in rows] == [3] and len(rows[0]["completion_head"]) < 300
    assert [r["index"] for r in beyond.json()["rollouts"]] == [3]  # its 20,000 tokens
    assert huge in export.text  # the export has it whole


def test_a_step_of_10000_rollouts_pages_by_group(session_factory: sessionmaker[Session]) -> None:
    run_id = make_run(session_factory, steps=0, group_size=8)
    rng = random.Random(6)
    rollouts = []
    for group in range(1250):
        for r in make_rollouts(rng, group_size=8):
            r.group = group
            rollouts.append(r)
    record_step(session_factory, run_id, 1, rollouts=rollouts)
    with client_for(session_factory) as client:
        overview = client.get(f"/runs/{run_id}/steps/1")
        step_json = client.get(f"/api/runs/{run_id}/steps/1?limit=500")
        found = client.get(f"/api/runs/{run_id}/rollouts?limit=200")
    assert overview.status_code == 200 and len(overview.content) < 2 * MB
    body = step_json.json()
    assert _json_size(step_json) < 2 * MB and body["total"] == 1250 and len(body["groups"]) == 500
    assert found.json()["total"] == 10_000 and len(found.json()["rollouts"]) == 200


def test_a_count_past_its_cap_says_so(session_factory: sessionmaker[Session]) -> None:
    run_id = make_run(session_factory, steps=6)
    with session_scope(session_factory) as session:
        query = queries.RolloutQuery()
        capped = queries.explore(session, run_id=run_id, query=query, count_cap=10)
        whole = queries.explore(session, run_id=run_id, query=query)
        rows = sum(1 for _ in store.iter_rollouts(session, run_id=run_id))
    assert (capped["total"], capped["total_capped"]) == (10, True)
    assert (whole["total"], whole["total_capped"]) == (rows, False) and rows > 10


@pytest.mark.parametrize("q", ["w " * 21, "w" * 201, "", "***"])
def test_a_search_that_cannot_be_run_is_a_400(
    session_factory: sessionmaker[Session], q: str
) -> None:
    run_id = make_run(session_factory, steps=1)
    with client_for(session_factory) as client:
        answer = client.get(f"/api/runs/{run_id}/rollouts", params={"q": q})
    assert answer.status_code == (200 if q == "" else 400), answer.text
