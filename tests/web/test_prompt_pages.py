"""The prompt lens's pages (issue 46): a run's prompts and their heatmap, one prompt's history,
the same prompts across runs, and the links to them. Every figure a page shows is checked
against the one the test computes by brute force from the run's rollouts
(tests.prompt_lens_support.oracle); HTML is asserted by parsing it."""

from __future__ import annotations

import json
import random
from typing import Any
from urllib.parse import parse_qs, urlparse

import plotly.graph_objects as go
import pytest
from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.display import fmt_num, fmt_pct
from rollout_lens.server.core.records import RolloutRecord
from rollout_lens.server.store import prompt_texts
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import PromptRow
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, HOSTILE, make_rollouts, record_step
from tests.prompt_lens_support import SIZE, STEPS, chatml, looks, oracle, schedule_run
from tests.prompt_pages_support import escalation_pair
from tests.web_support import Node, parse

# Where the database decides what a page shows (its order, filters, sums): both databases.
BOTH_DATABASES = pytest.mark.parametrize(
    "engine", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)


def _cells(row: Node) -> list[str]:
    return [td.text.strip() for td in row.children if isinstance(td, Node) and td.tag == "td"]


def _rows(html: str) -> list[Node]:
    return parse(html).by_id("prompts-table").find("tbody").find_all("tr")


def _ids(html: str) -> list[int]:
    return [int(r.attrs["data-prompt-id"]) for r in _rows(html)]


def _texts(factory: sessionmaker[Session]) -> dict[int, str]:
    with session_scope(factory) as session:
        return prompt_texts.texts(session, session.scalars(select(PromptRow.id)))


def _figure(html: str) -> dict[str, Any]:
    (figure,) = parse(html).json("page-data")["figures"]
    go.Figure({"data": figure["data"], "layout": figure["layout"]})  # valid Plotly, or raises
    return figure


def _stuck_group(step: int) -> list[RolloutRecord]:
    """A prompt every rollout fails alike: no reward spread, never solved (stuck)."""
    return [
        RolloutRecord(
            group=0, index=i, prompt=chatml("Query: what is stuck?"), completion="tool_09",
            completion_ids=[7], token_logprobs=[-0.5], control_probs={}, vote=None,
            target="tool_01", verifier_reward=0.0, true_score=0.0, advantage=0.0,
            format_valid=False, format_state="no_call", meta={"query": "what is stuck?"},
        )
        for i in range(SIZE)
    ]  # fmt: skip


@pytest.fixture
def schedules(session_factory: sessionmaker[Session]) -> tuple[int, dict[int, dict[str, Any]]]:
    """The schedules' run (tests.prompt_lens_support) with a stuck prompt in two more steps."""
    run_id = schedule_run(session_factory)
    for step in (STEPS + 1, STEPS + 2):
        record_step(session_factory, run_id, step, rollouts=_stuck_group(step))
    return run_id, oracle(session_factory, run_id)


@BOTH_DATABASES
def test_the_prompts_table_says_what_happened_to_each_prompt(
    client: TestClient, session_factory: sessionmaker[Session], schedules: Any
) -> None:
    run_id, truth = schedules
    response = client.get(f"/runs/{run_id}/prompts")
    assert response.status_code == 200
    page = parse(response.text)
    assert page.by_id("prompt-count").text == str(len(truth))
    # first seen first, ties by id: the default order
    expected = sorted(truth, key=lambda p: (truth[p]["first_step"], p))
    assert _ids(response.text) == expected
    texts = _texts(session_factory)
    for row in _rows(response.text):
        p = truth[int(row.attrs["data-prompt-id"])]
        cells = _cells(row)
        assert cells[1:6] == [
            str(p["groups"]),
            str(p["first_step"]),
            str(p["last_step"]),
            fmt_num(p["reward_mean"]),
            fmt_num(p["true_mean"]),
        ]
        assert row.find("td", data_field="solved_at").text == _step(p["solved_at"])
        assert row.find("td", data_field="last_failed").text.startswith(_step(p["last_failed"]))
        assert ("forgotten" in row.find("td", data_field="last_failed").text) == p["forgotten"]
        assert row.find("td", data_field="flips").text == str(p["flips"])
        assert row.find("td", data_field="zero_spread_share").text == fmt_pct(
            p["zero_spread_share"]
        )
        # the distinguishing text is the query the env named; the whole prompt is on demand
        assert row.find(cls="prompt-label").text.startswith(("what does ", "what is stuck"))
        whole = row.find("details", cls="prompt-text").find("pre").text
        assert whole == texts[int(row.attrs["data-prompt-id"])]
        votes = {c.attrs["title"].split(" voted ")[1].split(" (")[0]: int(c.find("b").text)
                 for c in row.find_all(cls="vote-chip")}  # fmt: skip
        top = sorted(p["votes"].items(), key=lambda kv: (kv[0] == "None", -kv[1], kv[0]))[:5]
        assert votes == {("malformed" if v == "None" else v): c for v, c in top}


def _step(value: int | None) -> str:
    return "—" if value is None else str(value)


@BOTH_DATABASES
@pytest.mark.parametrize("look", ["never_solved", "solved", "flipping", "stuck", "forgotten"])
def test_each_look_lists_the_prompts_it_names(
    client: TestClient, schedules: Any, look: str
) -> None:
    run_id, truth = schedules
    response = client.get(f"/runs/{run_id}/prompts", params={"look": look})
    assert response.status_code == 200
    want = {p for p, figures in truth.items() if look in looks(figures)}
    assert want, f"the schedules give no {look} prompt"
    assert set(_ids(response.text)) == want
    select_ = parse(response.text).by_id("look")
    assert [o.attrs["value"] for o in select_.find_all("option") if "selected" in o.attrs] == [look]


@BOTH_DATABASES
def test_sorting_searching_and_paging_keep_each_other(client: TestClient, schedules: Any) -> None:
    run_id, truth = schedules
    html = client.get(f"/runs/{run_id}/prompts", params={"sort": "flips", "order": "desc"}).text
    assert _ids(html) == sorted(truth, key=lambda p: (-truth[p]["flips"], -p))
    header = parse(html).by_id("prompts-table").find("th", data_sort="flips")
    assert header.attrs["aria-sort"] == "descending"
    # the header's link turns the order and keeps the search
    html = client.get(f"/runs/{run_id}/prompts", params={"q": "alternating"}).text
    (only,) = _ids(html)
    assert truth[only]["flips"] == max(p["flips"] for p in truth.values())
    link = parse(html).by_id("prompts-table").find("th", data_sort="solved_at").find("a")
    assert parse_qs(urlparse(link.attrs["href"]).query) == {
        "q": ["alternating"], "sort": ["solved_at"], "order": ["asc"]
    }  # fmt: skip
    # pages of 3 by the cursor add up to the whole list, in order
    seen: list[int] = []
    url: str | None = f"/runs/{run_id}/prompts?sort=true_mean&limit=3"
    while url:
        page = client.get(url).text
        seen += _ids(page)
        nxt = parse(page).find_all("a", id="next-page")
        url = nxt[0].attrs["href"] if nxt else None
    by_true = sorted(
        truth, key=lambda p: (truth[p]["true_mean"] is not None, truth[p]["true_mean"] or 0, p)
    )
    assert seen == by_true


@BOTH_DATABASES
def test_the_heatmap_is_the_tables_rows_by_steps(
    client: TestClient, session_factory: sessionmaker[Session], schedules: Any
) -> None:
    run_id, truth = schedules
    html = client.get(f"/runs/{run_id}/prompts", params={"sort": "flips", "order": "desc"}).text
    figure = _figure(html)
    (trace,) = figure["data"]
    assert trace["type"] == "heatmap"
    # rows in the table's order, each labelled by its id and its query
    order = _ids(html)
    assert [int(y.split()[0].lstrip("#")) for y in trace["y"]] == order
    steps = sorted({g["step"] for p in truth.values() for g in p["history"]})
    assert trace["x"] == steps  # 12 steps: a column a step
    for i, prompt_id in enumerate(order):
        groups = truth[prompt_id]["history"]
        for j, step in enumerate(steps):
            here = [g for g in groups if g["step"] == step]
            if not here:
                assert trace["z"][i][j] is None and trace["customdata"][i][j] is None
                continue
            trues = [t for g in here for t in g["_trues"]]
            rewards = [r for g in here for r in g["_rewards"]]
            value = sum(trues) / len(trues) if trues else sum(rewards) / len(rewards)
            assert trace["z"][i][j] == pytest.approx(value)
            first = min(here, key=lambda g: g["group"])
            assert trace["customdata"][i][j][:3] == [step, first["group"], len(here)]
    assert parse(html).json("page-data")["steps"] == f"/runs/{run_id}/steps"


@BOTH_DATABASES
def test_a_prompts_history_shows_every_group_and_its_completions(
    client: TestClient, schedules: Any
) -> None:
    run_id, truth = schedules
    prompt_id = max(truth, key=lambda p: truth[p]["flips"])  # alternating: twice at step 3
    history = truth[prompt_id]["history"]
    response = client.get(f"/runs/{run_id}/prompts/{prompt_id}")
    assert response.status_code == 200
    page = parse(response.text)
    assert page.find("dd", data_field="flips").text == str(truth[prompt_id]["flips"])
    rows = page.by_id("history-table").find("tbody").find_all("tr", cls="history-group")
    assert [(int(r.attrs["data-step"]), int(r.attrs["data-group"])) for r in rows] == [
        (g["step"], g["group"]) for g in history
    ]
    for row, g in zip(rows, history, strict=True):
        segments = row.find(cls="vote-bar").find_all(cls="vote-seg")
        shown = {s.attrs["title"].split(" × ")[1]: int(s.attrs["title"].split(" × ")[0])
                 for s in segments}  # fmt: skip
        assert shown == {("malformed" if v == "None" else v): c for v, c in g["votes"].items()}
        assert ("split" in row.find(cls="vote-bar").classes) == (len(g["votes"]) > 1)
        assert bool(row.find_all(cls="flag-stuck")) == g["zero_spread"]
        assert ("solved" in row.classes) == (g["solved"] is True)
        toggle = row.find("a", cls="completions-toggle")
        below = page.by_id(toggle.attrs["aria-controls"])  # the row under the group's
        assert (
            "completions-row" in below.classes and toggle.attrs["href"] == f"#{below.attrs['id']}"
        )
        completions = below.find("table", cls="rollout-rows").find("tbody").find_all("tr")
        assert [int(c.attrs["data-rollout-id"]) for c in completions] == g["rollout_ids"]
        for c, reward, adv in zip(completions, g["rewards"], g["advantages"], strict=True):
            cells = _cells(c)
            assert cells[2] == fmt_num(reward) and cells[4] == fmt_num(adv)
            assert cells[6].startswith("<tool>")  # the completion itself
            link = c.find("a").attrs["href"]
            assert link.startswith(f"/runs/{run_id}/steps/{g['step']}/groups/{g['group']}#r")
    figure = _figure(response.text)
    true, reward = figure["data"]
    assert [true["name"], reward["name"]] == ["true score", "reward"]
    assert reward["x"] == [g["step"] for g in history]
    assert reward["y"] == pytest.approx([g["reward_mean"] for g in history])
    assert true["y"] == pytest.approx([g["true_mean"] for g in history])


def test_the_run_step_viewer_and_compare_pages_link_to_the_lens(
    client: TestClient, session_factory: sessionmaker[Session], schedules: Any
) -> None:
    run_id, truth = schedules
    run_page = parse(client.get(f"/runs/{run_id}").text)
    assert run_page.by_id("prompts-link").attrs["href"] == f"/runs/{run_id}/prompts"
    # a group's page: one click to its prompt's history
    prompt_id, group = next(
        (p, g) for p, figures in truth.items() for g in figures["history"] if g["step"] == 5
    )
    group_page = parse(client.get(f"/runs/{run_id}/steps/5/groups/{group['group']}").text)
    link = group_page.by_id("prompt-history-link").attrs["href"]
    assert link == f"/runs/{run_id}/prompts/{prompt_id}"
    assert client.get(link).status_code == 200
    assert group_page.by_id("step-prompts").attrs["href"] == f"/runs/{run_id}/prompts"
    other = schedule_run(session_factory, steps=2)
    compare = parse(client.get(f"/compare?runs={run_id},{other}").text)
    href = compare.by_id("compare-prompts-link").attrs["href"]
    assert parse_qs(urlparse(href).query) == {"runs": [f"{run_id},{other}"]}


def test_parameters_that_do_not_parse_say_why(client: TestClient, schedules: Any) -> None:
    run_id, _ = schedules
    bad = client.get(f"/runs/{run_id}/prompts", params={"look": "sometimes"})
    assert bad.status_code == 422
    page = parse(bad.text)
    assert "look" in page.by_id("err-form").text
    assert page.find_all(id="filters-invalid")
    forged = client.get(f"/runs/{run_id}/prompts", params={"after": "bm90IG91cnM"})
    assert forged.status_code == 400
    assert "cursor" in parse(forged.text).by_id("err-form").text
    assert client.get(f"/runs/{run_id}/prompts/999999").status_code == 404
    # a history's and a comparison's bad parameters: the error page, saying which
    for url, status, words in (
        (f"/runs/{run_id}/prompts/1?after=bm90IG91cnM", 400, "after"),
        (f"/runs/{run_id}/prompts/1?limit=0", 422, "limit"),
        (f"/compare/prompts?runs={run_id}", 400, "runs"),
        (f"/compare/prompts?runs={run_id},{run_id}", 400, "runs"),
        ("/compare/prompts?runs=1,x", 400, "runs"),
        (f"/compare/prompts?runs={run_id},999999", 404, "999999"),
    ):
        answer = client.get(url)
        assert (answer.status_code, words in answer.text) == (status, True), url
        assert answer.headers["content-type"].startswith("text/html"), url
    # empty fields are dropped from the URL
    blank = client.get(f"/runs/{run_id}/prompts?q=&look=flipping", follow_redirects=False)
    assert blank.status_code == 303 and blank.headers["location"].endswith("?look=flipping")


@BOTH_DATABASES
def test_compare_matches_a_leaky_and_a_patched_run_by_query(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    pair = escalation_pair(session_factory, steps=6)
    leaky, patched = pair["leaky"], pair["patched"]
    response = client.get(f"/compare/prompts?runs={leaky},{patched}")
    assert response.status_code == 200
    page = parse(response.text)
    rows = page.by_id("matches-table").find("tbody").find_all("tr")
    # each training query is one prompt in both runs (64 tools listed in one, 4 in the other)
    assert sorted(r.find(cls="prompt-label").text for r in rows) == sorted(pair["queries"])
    for row in rows:
        links = [a.attrs["href"] for a in row.find_all("a") if "/prompts/" in a.attrs["href"]]
        assert [link.split("/")[2] for link in links] == [str(leaky), str(patched)]
    # the first match's histories side by side: six groups each, the leaky one split
    sides = page.find_all(cls="pair-side")
    assert [s.attrs["data-run"] for s in sides] == [str(leaky), str(patched)]
    for side in sides:
        assert len(side.find("table").find("tbody").find_all("tr")) == 6
    figures = page.json("page-data")["figures"]
    assert [len(f["data"][0]["x"]) for f in figures] == [6, 6]
    # the whole text or the last user turn tells them apart: nothing matches
    for match in ("exact", "user"):
        none = parse(client.get(f"/compare/prompts?runs={leaky},{patched}&match={match}").text)
        assert none.find_all(id="no-matches")


def _hostile_run(factory: sessionmaker[Session]) -> int:
    with session_scope(factory) as session:
        run_id = store.create_run(
            session, name=f"hostile {HOSTILE}", model="tiny", total_steps=2, group_size=8,
            control_tokens=CONTROL_TOKENS,
        ).id  # fmt: skip
    for step in (1, 2):
        rollouts: list[RolloutRecord] = make_rollouts(random.Random(step), completion=HOSTILE)
        for r in rollouts:
            r.prompt = f"<user>{HOSTILE} what tool?</user>"
            r.meta = r.meta | {"query": f"{HOSTILE} query"}
            r.vote = HOSTILE[:40]
        record_step(factory, run_id, step, values={"reward_mean": 0.5}, rollouts=rollouts)
    return run_id


def _inert(html: str) -> Node:
    """The page parsed, with no script or image but the page's own and no event-handler attribute."""
    page = parse(html)
    for script in page.find_all("script"):
        assert (
            script.attrs.get("src", "").startswith("/static/")
            or script.attrs.get("type") == "application/json"
        ), script
    assert not [n for n in page.iter() if any(a.startswith("on") for a in n.attrs)]
    assert all(img.attrs["src"].startswith("/static/") for img in page.find_all("img"))
    return page


def test_hostile_prompts_and_completions_are_text(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = _hostile_run(session_factory)
    other = _hostile_run(session_factory)
    html = client.get(f"/runs/{run_id}/prompts").text
    _inert(html)
    (row,) = _rows(html)
    assert HOSTILE in row.find(cls="prompt-label").text
    assert HOSTILE in row.find("details", cls="prompt-text").text
    (label,) = _figure(html)["data"][0]["y"]
    assert "<" not in label and "&lt;script&gt;" in label  # Plotly reads tags in labels
    prompt_id = int(row.attrs["data-prompt-id"])
    history = _inert(client.get(f"/runs/{run_id}/prompts/{prompt_id}").text)
    heads = [c.text for c in history.find_all("td", cls="completion-head")]
    assert heads and all(HOSTILE in h for h in heads)
    segment = history.find(cls="vote-bar").find(cls="vote-seg")
    assert HOSTILE[:40] in segment.attrs["title"] and segment.text.startswith(HOSTILE[:20])
    compare = _inert(client.get(f"/compare/prompts?runs={run_id},{other}").text)
    assert HOSTILE in compare.by_id("matches-table").find(cls="prompt-label").text


def test_the_export_link_downloads_what_the_filters_select(
    client: TestClient, session_factory: sessionmaker[Session], schedules: Any
) -> None:
    run_id, truth = schedules
    page = parse(client.get(f"/runs/{run_id}/prompts", params={"look": "never_solved"}).text)
    link = page.by_id("export-prompts")
    assert "download" in link.attrs
    want = {p for p, figures in truth.items() if "never_solved" in looks(figures)}
    assert link.text.strip() == f"Export {len(want)} as JSONL"
    export = client.get(link.attrs["href"])
    assert export.status_code == 200
    lines = [json.loads(line) for line in export.text.splitlines()]
    assert sorted(line["prompt_id"] for line in lines) == sorted(want)


def test_a_run_without_steps_says_so(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    with session_scope(session_factory) as session:
        run_id = store.create_run(
            session, name="fresh", model="tiny", total_steps=3, group_size=8,
            control_tokens=CONTROL_TOKENS,
        ).id  # fmt: skip
    response = client.get(f"/runs/{run_id}/prompts")
    assert response.status_code == 200
    page = parse(response.text)
    assert "No prompts recorded yet" in page.by_id("no-prompts").text
    assert page.json("page-data")["figures"] == []  # no empty heatmap drawn
    assert not page.find_all(id="fig-prompt-heatmap")
