"""The step viewer by group, in-process on a real SQLite file and on PostgreSQL: a step's groups
overview (rows and every sort against a brute-force computation over the same rollouts, the
filters, paging), a group's page and its table's disagreement flags, the JSON twins paged, the
404s and 422s, the one-group step as before, compare's one-group card."""

from __future__ import annotations

import math
import random
import statistics
import typing
from collections import Counter
from typing import Any

import pytest
from rollout_lens.server.core.records import RolloutRecord, disagrees
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.webapp.http.params import GroupSort, Look
from rollout_lens.server.webapp.queries import GROUPS_PER_PAGE, JSON_TOKENS, disagrees_sql, overview
from sqlalchemy import literal, select

from tests.factories import make_groups, make_run, record_step
from tests.sql_support import executed
from tests.web_support import parse

GROUPS = 20


def _truth_disagrees(reward: float, true: float | None) -> bool:
    """Verifier ≠ truth as the issue states it: reward ≥ 0.5 with true score 0, or reward < 0.5
    with true score 1."""
    if true is None:
        return False
    return (reward >= 0.5 and true == 0) or (reward < 0.5 and true == 1)


def _expected(rollouts: list[RolloutRecord]) -> dict[int, dict[str, Any]]:
    """Each group's overview row, computed here from the rollouts as written."""
    by_group: dict[int, list[RolloutRecord]] = {}
    for r in rollouts:
        by_group.setdefault(r.group, []).append(r)
    rows = {}
    for g, members in by_group.items():
        rewards = [r.verifier_reward for r in members]
        trues = [r.true_score for r in members]
        valid = [r.vote for r in members if r.vote is not None]
        agree = Counter(valid).most_common(1)[0][1] if valid else 0
        solved = all(t == 1 for t in trues)
        rows[g] = {
            "group": g,
            "size": len(members),
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "accuracy": statistics.fmean(t or 0 for t in trues),
            "correct": sum(t == 1 for t in trues),
            "agree": agree,
            "agreement": agree / len(members),
            "states": dict(Counter(r.format_state for r in members)),
            "broken": sum(
                (not r.format_valid) or r.format_state != "healthy_call" for r in members
            ),
            "disagree": sum(_truth_disagrees(r.verifier_reward, r.true_score) for r in members),
            "disagree_at": [
                r.index for r in members if _truth_disagrees(r.verifier_reward, r.true_score)
            ],
            "solved": solved,
            "stuck": len(set(rewards)) == 1 and not solved,
            "max_abs_advantage": max(abs(r.advantage) for r in members),
            "query": (members[0].meta or {}).get("query"),
            "prompt": members[0].prompt,
            "target": members[0].target,
        }
    return rows


def _record(
    session_factory: Any, *, seed: int = 7, groups: int = GROUPS, tokens: int = 4
) -> tuple[int, list[RolloutRecord]]:
    run_id = make_run(session_factory, steps=1, prompts_per_step=groups, seed=seed)
    rollouts = make_groups(random.Random(seed), groups=groups, tokens=tokens)
    record_step(session_factory, run_id, 2, values={"reward_mean": 0.5}, rollouts=rollouts)
    make_steps = make_groups(random.Random(seed + 1), groups=groups)
    record_step(session_factory, run_id, 3, values={"reward_mean": 0.5}, rollouts=make_steps)
    return run_id, rollouts


def _order(rows: dict[int, dict[str, Any]], key: str, desc: bool) -> list[int]:
    """Group ids sorted by `key` (labels: casefolded), ties in group order."""
    ordered = sorted(rows.values(), key=lambda r: r["group"])
    return [
        r["group"]
        for r in sorted(
            ordered,
            key=lambda r: str(r[key]).casefold() if key == "label" else r[key],
            reverse=desc,
        )
    ]


def _no_inline_script(page: Any) -> None:
    """CSP: scripts only from files (and the page-data JSON), no inline event handlers."""
    for script in page.find_all("script"):
        assert script.attrs.get("src") or script.attrs.get("type") == "application/json"
    assert not [n for n in page.iter() if any(a.startswith("on") for a in n.attrs)]


def test_the_sorts_and_looks_the_routes_take_are_the_viewers() -> None:
    (sorts,) = [a for a in typing.get_args(GroupSort) if typing.get_origin(a) is typing.Literal]
    assert set(typing.get_args(sorts)) == set(overview.GROUP_SORTS)
    looks = typing.get_args(typing.get_args(Look)[0])
    literal_looks = {
        v for a in looks if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)
    }
    assert literal_looks == set(overview.LOOKS)


@pytest.mark.parametrize("reward", [0.0, 0.25, 0.4999, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("true", [0.0, 0.5, 1.0, None])
def test_disagreement_is_one_definition_in_python_and_sql(
    session_factory: Any, reward: float, true: float | None
) -> None:
    expected = _truth_disagrees(reward, true)
    assert disagrees(reward, true) is expected
    with session_scope(session_factory) as session:
        found = session.scalar(select(disagrees_sql(literal(reward), literal(true))))
    assert bool(found) is expected


def test_prompt_labels_skip_what_every_prompt_of_the_step_shares() -> None:
    shared = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nPlease "
    heads = {1: shared + "add 2 and 3", 2: shared + "add 40 and 2", 3: shared + "find a <b>"}
    assert overview.prompt_labels(heads) == {
        1: "…Please add 2 and 3",
        2: "…Please add 40 and 2",
        3: "…Please find a <b>",
    }
    # a long shared line: from the word where they part
    long = "Solve this problem and put the final answer in a box, thinking step by step: "
    assert overview.prompt_labels({1: long + "2 + 2", 2: long + "3 × 7"}) == {
        1: "…2 + 2",
        2: "…3 × 7",
    }
    # short prompts that part on their first line are shown whole
    assert overview.prompt_labels({1: "say the color red", 2: "say the color blue"}) == {
        1: "say the color red",
        2: "say the color blue",
    }
    assert overview.prompt_labels({4: "  only one prompt  "}) == {4: "only one prompt"}
    same = overview.prompt_labels({5: "identical", 6: "identical"})
    assert same == {5: "identical", 6: "identical"}


def test_step_json_rows_match_a_brute_force_computation(session_factory, client) -> None:
    run_id, rollouts = _record(session_factory)
    expected = _expected(rollouts)
    data = client.get(f"/api/runs/{run_id}/steps/2").json()
    assert data["groups_in_step"] == data["total"] == GROUPS and data["offset"] == 0
    assert data["rollouts_in_step"] == len(rollouts)
    assert [g["group"] for g in data["groups"]] == sorted(expected)
    assert "rollouts" not in data["groups"][0]  # summaries only: no per-token arrays
    for got in data["groups"]:
        want = expected[got["group"]]
        for key in (
            "size",
            "correct",
            "agree",
            "broken",
            "disagree",
            "disagree_at",
            "solved",
            "stuck",
            "target",
        ):
            assert got[key] == want[key], (got["group"], key)
        for key in ("reward_mean", "reward_std", "accuracy", "agreement", "max_abs_advantage"):
            assert got[key] == pytest.approx(want[key]), (got["group"], key)
        assert got["states"] == want["states"]
        assert sum(v["count"] for v in got["votes"]) == want["size"]
        if want["query"]:
            assert got["label"] == want["query"]
        else:  # named by its prompt's head, past what all the step's prompts share
            assert got["label"].startswith("…") and got["label"][1:] in want["prompt"]
    counts = data["counts"]
    for look in overview.LOOKS:
        flagged = [g for g, r in expected.items() if r[look]]
        assert counts[look] == len(flagged), look
        only = client.get(f"/api/runs/{run_id}/steps/2?look={look}").json()
        assert [g["group"] for g in only["groups"]] == flagged and only["total"] == len(flagged)
    # the fixture's groups leave nothing to chance: every look finds some and misses some
    assert all(0 < counts[look] < GROUPS for look in overview.LOOKS), counts


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_every_overview_sort_matches_a_brute_force_sort(session_factory, client, order) -> None:
    run_id, rollouts = _record(session_factory)
    expected = _expected(rollouts)
    labels = {
        g["group"]: g["label"] for g in client.get(f"/api/runs/{run_id}/steps/2").json()["groups"]
    }
    for g, row in expected.items():
        row["label"] = labels[g]
    for key in overview.GROUP_SORTS:
        want = _order(expected, key, order == "desc")
        api = client.get(f"/api/runs/{run_id}/steps/2?sort={key}&order={order}").json()
        assert [g["group"] for g in api["groups"]] == want, key
        page = parse(client.get(f"/runs/{run_id}/steps/2?sort={key}&order={order}").text)
        rows = page.by_id("groups-table").find("tbody").find_all("tr")
        assert [int(r.attrs["data-group"]) for r in rows] == want, key
        header = page.find("th", cls="sorted")
        assert header.attrs["data-sort"] == key
        assert header.attrs["aria-sort"] == ("descending" if order == "desc" else "ascending")
        # the sorted column's link sorts it the other way
        flipped = parse(client.get(header.find("a").attrs["href"]).text)
        rows = flipped.by_id("groups-table").find("tbody").find_all("tr")
        assert [int(r.attrs["data-group"]) for r in rows] == _order(expected, key, order == "asc")


def test_overview_page_rows_flags_and_links(session_factory, client) -> None:
    run_id, rollouts = _record(session_factory)
    expected = _expected(rollouts)
    response = client.get(f"/runs/{run_id}/steps/2")
    assert response.status_code == 200
    page = parse(response.text)
    assert not page.find_all(cls="tab-panel")  # no group's rollouts on the overview
    rows = page.by_id("groups-table").find("tbody").find_all("tr")
    assert len(rows) == GROUPS
    for row in rows:
        g = int(row.attrs["data-group"])
        want = expected[g]
        assert row.find("a", cls="group-link").attrs["href"] == f"/runs/{run_id}/steps/2/groups/{g}"
        cells = [td.text.strip() for td in row.find_all("td")]
        assert cells[2] == f"{want['reward_mean']:.2f}" and cells[3] == f"{want['reward_std']:.2f}"
        assert cells[5] == f"{want['agree']}/{want['size']}"
        assert ("flag-disagree" in row.classes) is bool(want["disagree"])
        assert ("flag-stuck" in row.classes) is want["stuck"]
        assert ("flag-broken" in row.classes) is bool(want["broken"])
        assert ("flag-solved" in row.classes) is want["solved"]
        # untrusted text (a query with markup) is shown as text
        if want["query"]:
            assert row.find("td", cls="prompt-cell").find("a").text == want["query"]
    assert "<b>" not in response.text.split('id="groups-table"')[1]
    _no_inline_script(page)
    looks = {a.attrs["data-look"]: a for a in page.by_id("looks").find_all("a")}
    assert looks["disagree"].attrs["href"] == f"/runs/{run_id}/steps/2?look=disagree"
    assert looks["disagree"].find("b").text == str(
        sum(bool(r["disagree"]) for r in expected.values())
    )
    filtered = parse(
        client.get(f"/runs/{run_id}/steps/2?look=stuck&sort=reward_mean&order=desc").text
    )
    stuck = [
        int(r.attrs["data-group"])
        for r in filtered.by_id("groups-table").find("tbody").find_all("tr")
    ]
    assert stuck == _order({g: r for g, r in expected.items() if r["stuck"]}, "reward_mean", True)
    # the step links keep the sort and the filter
    assert (
        filtered.by_id("next-step").attrs["href"]
        == f"/runs/{run_id}/steps/3?sort=reward_mean&order=desc&look=stuck"
    )


def test_overview_and_json_page_without_gaps_or_repeats(session_factory, client) -> None:
    run_id, rollouts = _record(session_factory)
    want = _order(_expected(rollouts), "disagree", True)
    seen: list[int] = []
    path: str | None = f"/api/runs/{run_id}/steps/2?sort=disagree&order=desc&limit=7"
    pages = 0
    while path is not None:
        data = client.get(path).json()
        assert data["total"] == GROUPS and data["limit"] == 7
        seen += [g["group"] for g in data["groups"]]
        path = data["links"]["next"]
        pages += 1
    assert seen == want and pages == math.ceil(GROUPS / 7)
    last = client.get(f"/api/runs/{run_id}/steps/2?offset=14&limit=7").json()
    assert last["links"]["prev"].endswith("offset=7&limit=7") and last["links"]["next"] is None
    assert client.get(f"/api/runs/{run_id}/steps/2?offset=99").json()["groups"] == []


def test_group_page_table_tabs_and_neighbours(session_factory, client) -> None:
    run_id, rollouts = _record(session_factory)
    expected = _expected(rollouts)
    flagged = next(g for g, r in expected.items() if r["disagree"] and 0 < g < GROUPS - 1)
    page = parse(client.get(f"/runs/{run_id}/steps/2/groups/{flagged}").text)
    members = [r for r in rollouts if r.group == flagged]
    rows = page.by_id("group-table").find("tbody").find_all("tr")
    assert [int(r.attrs["data-index"]) for r in rows] == [r.index for r in members]
    marked = [int(r.attrs["data-index"]) for r in rows if "disagree" in r.classes]
    assert marked == expected[flagged]["disagree_at"]
    for row, r in zip(rows, members, strict=True):
        cells = [td.text.strip() for td in row.find_all("td")]
        assert cells[2] == f"{r.verifier_reward:.2f}" and cells[4] == f"{r.advantage:.2f}"
        assert cells[6] == r.format_state and cells[7] == str(len(r.completion_ids))
    tabs = page.by_id("rollout-tabs").find_all("button")
    assert [i for i, t in enumerate(tabs) if "disagree" in t.classes] == marked
    assert len(page.find_all("div", cls="tab-panel")) == len(members)
    _no_inline_script(page)
    assert page.by_id("prev-group").attrs["href"] == f"/runs/{run_id}/steps/2/groups/{flagged - 1}"
    assert page.by_id("next-group").attrs["href"] == f"/runs/{run_id}/steps/2/groups/{flagged + 1}"
    assert page.by_id("overview-link").attrs["href"] == f"/runs/{run_id}/steps/2"
    # moving between steps keeps the group
    assert page.by_id("next-step").attrs["href"] == f"/runs/{run_id}/steps/3/groups/{flagged}"
    assert page.by_id("step-nav").attrs["data-group"] == str(flagged)
    first = parse(client.get(f"/runs/{run_id}/steps/2/groups/0").text)
    assert (
        "disabled" in first.by_id("prev-group").classes
        and "href" not in first.by_id("prev-group").attrs
    )
    # the slider and jump box keep it too; a step without that group opens its overview
    jump = client.get(f"/runs/{run_id}/steps?step=3&group={flagged}", follow_redirects=False)
    assert jump.headers["location"] == f"/runs/{run_id}/steps/3/groups/{flagged}"
    away = client.get(f"/runs/{run_id}/steps?step=3&group={GROUPS + 5}", follow_redirects=False)
    assert away.headers["location"] == f"/runs/{run_id}/steps/3"
    # the old group switch (?group=) opens the group's page
    old = client.get(f"/runs/{run_id}/steps/2?group=3", follow_redirects=False)
    assert old.status_code == 307 and old.headers["location"] == f"/runs/{run_id}/steps/2/groups/3"


def test_group_json_pages_rollouts_and_cuts_token_arrays(session_factory, client) -> None:
    tokens = JSON_TOKENS + 44
    run_id, rollouts = _record(session_factory, groups=3, tokens=tokens)
    members = [r for r in rollouts if r.group == 1]
    base = f"/api/runs/{run_id}/steps/2/groups/1"
    data = client.get(base).json()
    assert data["rollouts_total"] == len(members) and data["next"] is None
    assert data["summary"]["disagree"] == _expected(rollouts)[1]["disagree"]
    for got, r in zip(data["rollouts"], members, strict=True):
        assert got["index"] == r.index and got["tokens_total"] == tokens
        assert got["completion_ids"] == r.completion_ids[:JSON_TOKENS].tolist()
        assert len(got["token_logprobs"]) == JSON_TOKENS
        assert {t: len(p) for t, p in got["control_token_probs"].items()} == dict.fromkeys(
            r.control_probs, JSON_TOKENS
        )
        assert got["disagree"] is _truth_disagrees(r.verifier_reward, r.true_score)
        assert got["completion"] == r.completion  # text whole: only arrays are cut
    full = client.get(f"{base}?max_tokens={tokens}").json()
    assert [r["completion_ids"] for r in full["rollouts"]] == [
        r.completion_ids.tolist() for r in members
    ]
    seen: list[int] = []
    path: str | None = f"{base}?limit=3&max_tokens=2"
    while path is not None:
        part = client.get(path).json()
        assert len(part["rollouts"]) <= 3 and all(
            len(r["completion_ids"]) == 2 for r in part["rollouts"]
        )
        seen += [r["index"] for r in part["rollouts"]]
        path = part["next"]
    assert seen == [r.index for r in members]


def test_missing_groups_are_404_and_bad_parameters_422(session_factory, client) -> None:
    run_id, _ = _record(session_factory, groups=3)
    for path in (f"/runs/{run_id}/steps/2/groups/3", f"/api/runs/{run_id}/steps/2/groups/3"):
        response = client.get(path)
        assert response.status_code == 404, path
        assert f"step 2 of run {run_id} has no group 3" in response.text
    page = parse(client.get(f"/runs/{run_id}/steps/2/groups/7").text)
    assert page.find("a", cls="primary").attrs["href"] == f"/runs/{run_id}/steps/2"  # the overview
    assert client.get(f"/api/runs/{run_id}/steps/9/groups/0").json()["nearest_step"] == 3
    assert client.get(f"/runs/{run_id + 1}/steps/2/groups/0").status_code == 404
    for path in (
        f"/runs/{run_id}/steps/2?sort=bogus",
        f"/runs/{run_id}/steps/2?order=up",
        f"/runs/{run_id}/steps/2?look=everything",
        f"/runs/{run_id}/steps/2?offset=-1",
        f"/api/runs/{run_id}/steps/2?limit=0",
        f"/api/runs/{run_id}/steps/2?limit=501",
        f"/api/runs/{run_id}/steps/2?sort=prompt",
        f"/api/runs/{run_id}/steps/2/groups/-1",
        f"/api/runs/{run_id}/steps/2/groups/0?max_tokens=-1",
        f"/api/runs/{run_id}/steps/2/groups/0?limit=33",
        f"/runs/{run_id}/steps/2/groups/x",
    ):
        response = client.get(path)
        assert response.status_code == 422, path
        assert response.headers["content-type"].startswith(
            "application/json" if "/api/" in path else "text/html"
        ), path


def test_a_one_group_step_stays_as_it_was(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=2, seed=3)
    page = parse(client.get(f"/runs/{run_id}/steps/2").text)
    assert not page.find_all(id="groups-overview") and not page.find_all(id="group-nav")
    assert len(page.find_all("div", cls="tab-panel")) == 8
    assert page.find(cls="group-card") is not None
    assert len(page.by_id("group-table").find("tbody").find_all("tr")) == 8
    assert page.by_id("next-step").attrs.get("href") is None  # the last step
    assert page.by_id("prev-step").attrs["href"] == f"/runs/{run_id}/steps/1"
    data = client.get(f"/api/runs/{run_id}/steps/2").json()
    assert data["groups_in_step"] == 1 and len(data["groups"]) == 1


def test_compare_shows_one_group_of_a_step_and_says_how_many(session_factory, client) -> None:
    a, _ = _record(session_factory, groups=5)
    b = make_run(session_factory, steps=3, seed=9)
    page = parse(client.get(f"/compare?runs={a},{b}&step=2").text)
    cards = page.find_all(cls="step-card")
    assert cards[0].attrs["data-group"] == "0" and cards[0].attrs["data-groups"] == "5"
    assert len(cards[0].find("table", cls="rollout-table").find("tbody").find_all("tr")) == 8
    assert "Group 0 of 5 groups" in cards[0].find(cls="step-card-groups").text
    assert cards[1].attrs["data-groups"] == "1" and not cards[1].find_all(cls="step-card-groups")
    card = parse(client.get(f"/runs/{a}/steps/2/card?group=3").text).find(cls="step-card")
    assert card.attrs["data-group"] == "3"
    links = [x.attrs["href"] for x in card.find(cls="step-card-groups").find_all("a")]
    assert links == [f"/runs/{a}/steps/2", f"/runs/{a}/steps/2/groups/3"]
    missing = parse(client.get(f"/runs/{b}/steps/2/card?group=3").text)
    assert "no group 3" in missing.find(cls="step-card").text
    api = client.get(f"/api/compare?runs={a},{b}&step=2&group=4").json()
    side = api["side_by_side"][0]["detail"]
    assert side["header"]["group"] == 4 and side["group_nav"]["count"] == 5
    assert {r["group"] for r in side["rollouts"]} == {4}


def test_the_overview_pages_a_step_of_many_groups(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=0, prompts_per_step=GROUPS_PER_PAGE + 5)
    rollouts = make_groups(random.Random(3), groups=GROUPS_PER_PAGE + 5, group_size=2)
    record_step(session_factory, run_id, 1, values={"reward_mean": 0.5}, rollouts=rollouts)
    seen: list[int] = []
    path: str | None = f"/runs/{run_id}/steps/1?sort=reward_mean&order=desc"
    while path is not None:
        page = parse(client.get(path).text)
        rows = page.by_id("groups-table").find("tbody").find_all("tr")
        assert len(rows) <= GROUPS_PER_PAGE
        seen += [int(r.attrs["data-group"]) for r in rows]
        nxt = page.find("nav", cls="pager").find_all("a", rel="next")
        path = nxt[0].attrs["href"] if nxt else None
    assert seen == _order(_expected(rollouts), "reward_mean", True)
    assert "groups 101–105 of 105" in page.find("nav", cls="pager").text


ARRAYS = ("completion_ids", "token_logprobs", "control_probs", "completion")


def test_the_overview_reads_no_token_arrays_and_stays_small(session_factory, client) -> None:
    """64 groups × 8 rollouts: the overview's statements name no array or completion column,
    and the page stays under 300 KB; a group's JSON of 16 rollouts × 1,024 tokens under 2 MB."""
    run_id = make_run(session_factory, steps=0, prompts_per_step=64)
    rollouts = make_groups(random.Random(5), groups=64, tokens=8)
    big = make_groups(random.Random(6), groups=1, group_size=16, tokens=1024)
    for r in big:
        r.group = 64
    record_step(session_factory, run_id, 1, values={"reward_mean": 0.5}, rollouts=rollouts + big)
    engine = session_factory.kw["bind"]
    with executed(engine) as ran:
        page = client.get(f"/runs/{run_id}/steps/1?sort=disagree&order=desc")
        data = client.get(f"/api/runs/{run_id}/steps/1?limit=500").json()
    rollout_reads = [s for s, _ in ran if "FROM rollouts" in s]
    assert rollout_reads and not [s for s in rollout_reads for a in ARRAYS if f"rollouts.{a}" in s]
    assert page.status_code == 200 and len(page.content) < 300 * 1024
    assert data["total"] == 65 and len(data["groups"]) == 65
    group = client.get(f"/api/runs/{run_id}/steps/1/groups/64")
    assert len(group.json()["rollouts"]) == 16 and len(group.content) < 2 * 2**20


def test_a_group_shows_the_text_recorded_for_each_token(session_factory, client) -> None:
    """Each rollout of a group comes back with the piece its recorder gave every token id (the
    run's token texts, read for all of the page's ids at once), and its page shows them."""
    run_id = make_run(session_factory, steps=1, prompts_per_step=2, seed=5)
    rollouts = make_groups(random.Random(5), groups=2, tokens=6)
    for r in rollouts:
        r.meta = {**r.meta, "tokens": [f"Ġp{i}" for i in r.completion_ids]}
    record_step(session_factory, run_id, 2, values={"reward_mean": 0.5}, rollouts=rollouts)
    data = client.get(f"/api/runs/{run_id}/steps/2/groups/1").json()
    members = [r for r in rollouts if r.group == 1]
    assert [got["token_pieces"] for got in data["rollouts"]] == [r.meta["tokens"] for r in members]
    page = client.get(f"/runs/{run_id}/steps/2/groups/1").text
    assert all(f"p{i}" in page for r in members for i in r.completion_ids)


def _run_with_token_texts(session_factory, seed: int) -> tuple[int, list[RolloutRecord]]:
    """A run of one step of one group whose tokens' texts are recorded (Ġp<id>)."""
    run_id = make_run(session_factory, steps=0, prompts_per_step=1, seed=seed)
    rollouts = make_groups(random.Random(seed), groups=1, tokens=6)
    for r in rollouts:
        r.tokens = [f"Ġp{i}" for i in r.completion_ids]
    record_step(session_factory, run_id, 1, values={"reward_mean": 0.5}, rollouts=rollouts)
    return run_id, rollouts


def test_the_group_pages_read_a_runs_token_texts_once(session_factory, client) -> None:
    """The group page, its JSON twin, the one-group step page, compare (page and JSON) and its
    step card share the app's token texts: the second time a group is shown no token text is
    read, and every answer is the same."""
    run_id, rollouts = _run_with_token_texts(session_factory, 5)
    other, _ = _run_with_token_texts(session_factory, 6)
    engine = session_factory.kw["bind"]
    urls = [f"/runs/{run_id}/steps/1/groups/0", f"/api/runs/{run_id}/steps/1/groups/0"]
    urls.append(f"/runs/{run_id}/steps/1")  # one group: the step page shows it
    urls += [f"/compare?runs={other},{run_id}", f"/api/compare?runs={other},{run_id}"]
    urls.append(f"/runs/{other}/steps/1/card")
    pages = []
    for _ in range(2):
        with executed(engine) as ran:
            pages.append([client.get(url).text for url in urls])
        pages[-1].append(sum("run_tokens" in statement for statement, _ in ran))
    assert pages[0][-1] == 2 and pages[1][-1] == 0  # each run's texts once
    shown = {f"p{i}" for r in rollouts for i in r.completion_ids}
    assert pages[0][:-1] == pages[1][:-1] and all(p in pages[0][0] for p in shown)
