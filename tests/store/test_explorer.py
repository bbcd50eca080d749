"""The rollout explorer against a brute-force answer computed in Python over the same rows: every
filter, every sort (paged through to the end), full-text search by the databases' own engines,
keyset paging while steps are being written, and the errors a bad query gets."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord, StepRecord, disagrees
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.serialize import completion_ids, completion_text
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS
from tests.web_support import client_for, explorer_pages, parse

WORDS = ["alpha", "beta", "gamma", "delta", "tool", "call", "Überweg", "x1y2", "answer", "none"]
STATES = ["healthy_call", "collapse", "text_pollution", None]
TOKEN_TEXTS = {i: (" " if i % 3 else "") + w for i, w in enumerate(WORDS)}  # ids → pieces


def _rollouts(rng: random.Random, step: int) -> list[RolloutRecord]:
    out = []
    for group in range(3):
        prompt = f"Tools: tool_{group:02d} lookup. Query: {rng.choice(WORDS)} prompt{group}"
        target = f"tool_{rng.randrange(4):02d}"
        for index in range(4):
            ids = [rng.randrange(len(WORDS)) for _ in range(rng.randrange(0, 9))]
            text = "".join(TOKEN_TEXTS[i] for i in ids)
            own_text = rng.random() < 0.25  # text that the ids do not rebuild: stored as text
            reward = rng.choice([0.0, 0.25, 0.5, 1.0])
            out.append(
                RolloutRecord(
                    group=group,
                    index=index,
                    prompt=prompt,
                    completion=text + (" (edited)" if own_text else ""),
                    completion_ids=ids,
                    token_logprobs=[-rng.random() for _ in ids],
                    control_probs={t: [rng.random() for _ in ids] for t in CONTROL_TOKENS},
                    vote=rng.choice([None, "tool_00", "tool_01", "tool_02"]),
                    target=target,
                    verifier_reward=reward,
                    true_score=rng.choice([None, 0.0, 1.0]),
                    advantage=round(rng.uniform(-2, 2), 3),
                    format_valid=rng.random() < 0.7,
                    format_state=rng.choice(STATES),
                    tokens=[TOKEN_TEXTS[i] for i in ids],
                )
            )
    return out


def _record(factory: sessionmaker[Session], run_id: int, rng: random.Random, steps: range) -> None:
    with session_scope(factory) as session:
        recorder = None
        for step in steps:
            record = StepRecord(step, step, {"reward_mean": 0.5}, _rollouts(rng, step))
            recorder = store.record_step(
                session,
                run_id=run_id,
                record=record,
                control_tokens=CONTROL_TOKENS,
                recorder=recorder,
            )


@pytest.fixture
def explored(session_factory: sessionmaker[Session]) -> tuple[int, list[dict[str, Any]]]:
    """A run of 6 steps × 3 groups × 4 rollouts and its rows as Python sees them."""
    with session_scope(session_factory) as session:
        run_id = store.create_run(
            session, name="explored", model="m", total_steps=6, group_size=4,
            control_tokens=CONTROL_TOKENS,
        ).id  # fmt: skip
    _record(session_factory, run_id, random.Random(7), range(1, 7))
    return run_id, _truth(session_factory, run_id)


def _truth(factory: sessionmaker[Session], run_id: int) -> list[dict[str, Any]]:
    with session_scope(factory) as session:
        texts = store.token_texts(session, run_id=run_id)
        return [
            {
                "id": r.id,
                "step": r.step,
                "group": r.group,
                "index": r.index,
                "vote": r.vote,
                "target": r.target,
                "reward": r.verifier_reward,
                "true_score": r.true_score,
                "advantage": r.advantage,
                "sum_logprob": r.sum_logprob,
                "length": r.n_tokens,
                "state": r.format_state,
                "format_valid": r.format_valid,
                "disagree": disagrees(r.verifier_reward, r.true_score),
                "text": completion_text(r, completion_ids(r), texts),
                "prompt": prompt,
            }
            for r, prompt in store.iter_rollouts(session, run_id=run_id)
        ]


def _words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[^\W_]+", text)}


def _has(row: dict[str, Any], q: str) -> bool:
    terms = re.findall(r"[^\W_]+\*?", q.lower())

    def within(text: str) -> bool:
        words = _words(text)
        return all(
            any(w.startswith(t[:-1]) for w in words) if t.endswith("*") else t in words
            for t in terms
        )

    return within(row["text"]) or within(row["prompt"])


FILTERS: list[tuple[str, Any]] = [
    ("steps=2:4", lambda r: 2 <= r["step"] <= 4),
    ("steps=5", lambda r: r["step"] == 5),
    ("steps=:2", lambda r: r["step"] <= 2),
    ("group=1", lambda r: r["group"] == 1),
    ("state=collapse", lambda r: r["state"] == "collapse"),
    ("format_valid=false", lambda r: not r["format_valid"]),
    ("vote=tool_01", lambda r: r["vote"] == "tool_01"),
    ("target=tool_02", lambda r: r["target"] == "tool_02"),
    ("reward_min=0.25&reward_max=0.5", lambda r: 0.25 <= r["reward"] <= 0.5),
    ("true_min=1", lambda r: r["true_score"] is not None and r["true_score"] >= 1),
    ("true_max=0", lambda r: r["true_score"] is not None and r["true_score"] <= 0),
    ("adv_min=1", lambda r: r["advantage"] >= 1),
    ("adv_max=-0.5", lambda r: r["advantage"] <= -0.5),
    ("len_min=3&len_max=5", lambda r: r["length"] is not None and 3 <= r["length"] <= 5),
    ("disagree=1", lambda r: r["disagree"]),
    ("q=gamma", lambda r: _has(r, "gamma")),
    ("q=alpha+beta", lambda r: _has(r, "alpha beta")),
    ("q=GAM*", lambda r: _has(r, "gam*")),
    ("q=prom*", lambda r: _has(r, "prom*")),  # a prefix in the prompts
    ("q=gamma+al*", lambda r: _has(r, "gamma al*")),
    ("q=al*+gam*", lambda r: _has(r, "al* gam*")),
    ("q=prompt2+pro*", lambda r: _has(r, "prompt2 pro*")),
    ("q=edited", lambda r: _has(r, "edited")),
    ("q=prompt2", lambda r: _has(r, "prompt2")),
    ("q=%C3%BCberweg", lambda r: _has(r, "überweg")),
    ("q=x1y2", lambda r: _has(r, "x1y2")),
    ("q=tool_01", lambda r: _has(r, "tool 01")),
    ("q=nowhere", lambda r: False),
    # q with a filter: counted from the rollouts, not as the index counts q's matches alone (on
    # PostgreSQL, where no prompt matches: `edited` and `edi*` are in completions only)
    ("q=edited&steps=2:4", lambda r: _has(r, "edited") and 2 <= r["step"] <= 4),
    ("q=edi*&group=1", lambda r: _has(r, "edi*") and r["group"] == 1),
    ("q=gamma&steps=2:4", lambda r: _has(r, "gamma") and 2 <= r["step"] <= 4),
    (
        "state=healthy_call&disagree=1&steps=1:3",
        lambda r: r["state"] == "healthy_call" and r["disagree"] and 1 <= r["step"] <= 3,
    ),  # fmt: skip
]


@pytest.mark.parametrize(("query", "keep"), FILTERS, ids=[f for f, _ in FILTERS])
def test_every_filter_matches_the_brute_force_answer(
    session_factory: sessionmaker[Session], explored: Any, query: str, keep: Any
) -> None:
    run_id, truth = explored
    expected = sorted((r["step"], r["id"]) for r in truth if keep(r))
    with client_for(session_factory) as client:
        rows, total = explorer_pages(client, f"/api/runs/{run_id}/rollouts?{query}&limit=5")
    assert [(r["step"], r["id"]) for r in rows] == expected
    assert total == len(expected)
    by_id = {r["id"]: r for r in truth}
    for row in rows:
        assert row["disagree"] == by_id[row["id"]]["disagree"]
        assert row["rollout_url"].endswith(
            f"/steps/{row['step']}/groups/{row['group']}#r{row['index']}"
        )


def _expected_order(truth: list[dict[str, Any]], sort: str, order: str) -> list[int]:
    """The explorer's order: by value then id (both reversed going down), NULLs first going up
    and last going down."""

    def value(row: dict[str, Any]) -> Any:
        return abs(row["advantage"]) if sort == "abs_advantage" else row[sort]

    down = order == "desc"
    present = sorted(
        (r for r in truth if value(r) is not None), key=lambda r: (value(r), r["id"]), reverse=down
    )
    nulls = sorted((r for r in truth if value(r) is None), key=lambda r: r["id"], reverse=down)
    return [r["id"] for r in (present + nulls if down else nulls + present)]


SORTS = ["step", "group", "index", "reward", "true_score", "advantage", "abs_advantage",
         "sum_logprob", "length", "vote", "target", "state"]  # fmt: skip


@pytest.mark.parametrize("order", ["asc", "desc"])
@pytest.mark.parametrize("sort", SORTS)
def test_every_sort_pages_through_every_row_in_order(
    session_factory: sessionmaker[Session], explored: Any, sort: str, order: str
) -> None:
    run_id, truth = explored
    with client_for(session_factory) as client:
        rows, _ = explorer_pages(
            client, f"/api/runs/{run_id}/rollouts?sort={sort}&order={order}&limit=7"
        )
    assert [r["id"] for r in rows] == _expected_order(truth, sort, order)


def test_a_word_in_more_prompts_than_a_query_has_marks_is_searched(
    session_factory: sessionmaker[Session],
) -> None:
    """A dataset's every prompt holds its template's words: a search for one of them matches
    1,100 prompts (past 1,000, where the explorer once refused, and past what one statement's
    marks could hold) and finds every rollout they have, as the brute force does."""
    rng = random.Random(5)
    prompts = 1100
    with session_scope(session_factory) as session:
        run_id = store.create_run(
            session, name="dataset", model="m", total_steps=1, group_size=1,
            control_tokens=CONTROL_TOKENS,
        ).id  # fmt: skip
        rollouts = []
        for group in range(prompts):
            ids = [rng.randrange(len(WORDS)) for _ in range(3)]
            rollouts.append(
                RolloutRecord(
                    group=group,
                    index=0,
                    prompt=f"Tools: tool_{group % 64:02d}. Query: template item{group}",
                    completion="".join(TOKEN_TEXTS[i] for i in ids),
                    completion_ids=ids,
                    token_logprobs=[-0.5 for _ in ids],
                    control_probs={c: [0.5 for _ in ids] for c in CONTROL_TOKENS},
                    vote=None,
                    target=None,
                    verifier_reward=0.5,
                    true_score=None,
                    advantage=0.0,
                    format_valid=True,
                    format_state=None,
                    tokens=[TOKEN_TEXTS[i] for i in ids],
                )
            )
        store.record_step(
            session,
            run_id=run_id,
            record=StepRecord(1, 1, {"reward_mean": 0.5}, rollouts),
            control_tokens=CONTROL_TOKENS,
        )
    truth = _truth(session_factory, run_id)
    with client_for(session_factory) as client:
        for q in ["template", "templ*", "template+item1*", "templ*+item10*", "tool_07+query"]:
            rows, total = explorer_pages(client, f"/api/runs/{run_id}/rollouts?q={q}&limit=200")
            expected = sorted(r["id"] for r in truth if _has(r, q.replace("+", " ")))
            assert expected, q
            assert sorted(r["id"] for r in rows) == expected, q
            assert total == len(expected), q


def test_keyset_pages_have_no_gap_or_repeat_while_steps_are_written(
    session_factory: sessionmaker[Session], explored: Any
) -> None:
    run_id, truth = explored
    rng = random.Random(11)
    seen: list[int] = []
    with client_for(session_factory) as client:
        page = client.get(f"/api/runs/{run_id}/rollouts?sort=advantage&order=desc&limit=4").json()
        step = 7
        while True:
            seen += [r["id"] for r in page["rollouts"]]
            _record(session_factory, run_id, rng, range(step, step + 1))  # a step lands
            step += 1
            if not page["next_url"]:
                break
            page = client.get(page["next_url"]).json()
    assert len(seen) == len(set(seen))  # no repeat
    assert set(r["id"] for r in truth) <= set(seen)  # no gap: every row that was there is seen


@pytest.mark.parametrize(
    ("query", "status", "says"),
    [
        ("steps=x", 422, "steps is a step"),
        ("sort=completion", 422, "sort"),
        ("limit=1000", 422, "limit"),
        ("reward_min=abc", 422, "reward_min"),
        ("q=%21%21%21", 400, "at least one word"),
        ("q=" + "+".join(f"w{i}" for i in range(40)), 400, "at most 20 words"),
        ("after=garbage", 400, "not a cursor"),
        ("bogus=1", 422, "bogus"),
    ],
)
def test_a_bad_query_gets_a_clear_error(
    session_factory: sessionmaker[Session], explored: Any, query: str, status: int, says: str
) -> None:
    run_id, _ = explored
    with client_for(session_factory) as client:
        response = client.get(f"/api/runs/{run_id}/rollouts?{query}")
        page = client.get(f"/runs/{run_id}/rollouts?{query}")
    assert response.status_code == status and says in response.text
    assert page.status_code == status and says in page.text


@pytest.mark.parametrize(
    ("query", "field", "says"),
    [
        ("steps=abc&vote=tool_01", "steps", "steps is a step (12) or a range A:B"),
        ("reward_min=x&steps=2", "reward_min", "valid number"),
        ("group=-1", "group", "greater than or equal to 0"),
        ("q=%21%21%21", "q", "at least one word"),
        ("after=garbage", "form", "not a cursor"),
        ("bogus=1", "form", "bogus is not a filter of this page"),
    ],
)
def test_a_bad_value_keeps_the_explorer_with_the_field_marked(
    session_factory: sessionmaker[Session], explored: Any, query: str, field: str, says: str
) -> None:
    """Not a bare error page: the explorer's form as typed, the field marked and its reason
    beside it (aria-describedby), no rows, the count left out."""
    run_id, _ = explored
    with client_for(session_factory) as client:
        page = client.get(f"/runs/{run_id}/rollouts?{query}")
    assert page.status_code in (400, 422)
    doc = parse(page.text)
    form = doc.by_id("explorer-filters")
    message = doc.by_id(f"err-{field}")
    assert says in message.text, message.text
    if field != "form":
        (marked,) = [n for n in form.iter() if n.attrs.get("aria-invalid") == "true"]
        assert marked.attrs["name"] == field and marked.attrs["aria-describedby"] == f"err-{field}"
    typed = dict(pair.split("=", 1) for pair in query.split("&"))
    for name, value in typed.items():  # every value stays as typed (to correct, not retype)
        inputs = form.find_all("input", name=name)
        if inputs and name not in ("after", "bogus", "q"):
            assert inputs[0].attrs["value"] == value, name
    assert doc.by_id("filters-invalid") and not doc.find_all(id="rollouts-table")
    assert not doc.find_all(id="rollout-count")


def test_the_filter_form_leaves_empty_fields_out_of_the_url(
    session_factory: sessionmaker[Session], explored: Any
) -> None:
    """A GET form sends every field: the explorer redirects to the URL with the filled ones."""
    run_id, _ = explored
    empty = "q=&steps=2&group=&state=&format_valid=&vote=&reward_min=&reward_max=&len_min="
    with client_for(session_factory) as client:
        moved = client.get(f"/runs/{run_id}/rollouts?{empty}", follow_redirects=False)
        blank = client.get(f"/runs/{run_id}/rollouts?q=&state=", follow_redirects=False)
        page = client.get(moved.headers["location"])
    assert (
        moved.status_code == 303 and moved.headers["location"] == f"/runs/{run_id}/rollouts?steps=2"
    )
    assert blank.headers["location"] == f"/runs/{run_id}/rollouts"
    form = parse(page.text).by_id("explorer-filters")
    # Only a sort other than the default travels as a hidden field; no value-like placeholder.
    assert not form.find_all("input", name="sort") and not form.find_all("input", name="order")
    placeholders = [n.attrs["placeholder"] for n in form.iter() if "placeholder" in n.attrs]
    assert placeholders == ["words in the completion or prompt (word* for a prefix)"]


def test_a_cursor_is_refused_for_another_sort(
    session_factory: sessionmaker[Session], explored: Any
) -> None:
    run_id, _ = explored
    with client_for(session_factory) as client:
        cursor = client.get(f"/api/runs/{run_id}/rollouts?limit=2").json()["next"]
        refused = client.get(f"/api/runs/{run_id}/rollouts?limit=2&sort=reward&after={cursor}")
        missing = client.get("/api/runs/999/rollouts")
    assert refused.status_code == 400 and "another sort" in refused.text
    assert missing.status_code == 404


def test_the_explorer_page_lists_escapes_and_links(
    session_factory: sessionmaker[Session], explored: Any
) -> None:
    run_id, truth = explored
    with client_for(session_factory) as client:
        html = client.get(f"/runs/{run_id}/rollouts?q=gamma&sort=advantage&order=desc&limit=3")
    assert html.status_code == 200
    doc = parse(html.text)
    table = doc.find(id="rollouts-table")
    body_rows = [tr for tr in table.find_all("tr") if tr.attrs.get("data-rollout-id")]
    matching = sorted(
        (r for r in truth if _has(r, "gamma")), key=lambda r: (-r["advantage"], -r["id"])
    )
    assert [int(tr.attrs["data-rollout-id"]) for tr in body_rows] == [r["id"] for r in matching[:3]]
    assert doc.find(id="rollout-count").text.strip() == str(len(matching))
    next_link = doc.find(id="next-page")
    assert (
        next_link is not None
        and "after=" in next_link.attrs["href"]
        and "q=gamma" in next_link.attrs["href"]
    )
    # every sortable header keeps the search
    headers = [a.attrs["href"] for a in table.find("thead").find_all("a")]
    assert headers and all("q=gamma" in h for h in headers)


def test_the_client_and_the_cli_find_what_the_api_finds(
    session_factory: sessionmaker[Session], explored: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pandas")  # the optional `pandas` extra (the train extra brings it)
    from rollout_lens.cli import main
    from rollout_lens.client import Client

    run_id, truth = explored
    expected = _expected_order(
        [r for r in truth if r["step"] >= 2 and r["disagree"]], "reward", "desc"
    )
    with client_for(session_factory) as http:
        lens = Client("http://testserver")
        lens._http = http  # the in-process app: the client's own code, no socket
        frame = lens.rollouts(run_id, steps=(2, None), disagree=True, sort="reward", order="desc")
        capped = lens.rollouts(run_id, max_rows=3)
    assert list(frame["id"]) == expected
    assert list(frame["verifier_reward"]) == sorted(frame["verifier_reward"], reverse=True)
    assert len(capped) == 3

    url = session_factory.kw["bind"].url.render_as_string(hide_password=False)
    env = {"ROLLOUT_LENS_DATABASE_URL": url}
    argv = ["rollouts", str(run_id), "--steps", "2:", "--disagree", "--sort", "reward"]
    argv += ["--order", "desc", "--format", "csv", "--limit", "100"]
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        assert main(argv) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert [int(line.split(",")[0]) for line in lines[1:]] == expected
        assert main(["rollouts", str(run_id), "--steps", "x"]) == 2
        assert "--steps: " in capsys.readouterr().err


def test_an_alert_links_to_the_rollouts_that_tripped_it(
    session_factory: sessionmaker[Session],
) -> None:
    from rollout_lens.server.core.vocab import COLLAPSED

    from tests.factories import make_rollouts, make_run, record_step

    run_id = make_run(session_factory, steps=0, prompts_per_step=4)  # alerts judge one step
    rng = random.Random(3)
    for step in range(1, 9):
        rollouts = make_rollouts(rng)
        if step == 6:  # a collapse: most of the step's rollouts lose their call structure
            for r in rollouts[:6]:
                r.format_state = "collapse"
        record_step(
            session_factory,
            run_id,
            step,
            rollouts=rollouts,
            metrics={COLLAPSED: 0.75 if step == 6 else 0.0},
        )
    with client_for(session_factory) as client:
        alerts = client.get(f"/api/runs/{run_id}/alerts").json()
        collapse = next(a for a in alerts if a["kind"] == "collapse")
        assert collapse["step"] == 6 and "state=collapse" in collapse["rollouts_url"]
        found = client.get(collapse["rollouts_url"])
        run_page = client.get(f"/runs/{run_id}")
    rows = parse(found.text).find(id="rollouts-table").find_all("tr")
    listed = [tr for tr in rows if tr.attrs.get("data-rollout-id")]
    assert len(listed) == 6  # the step's six collapsed rollouts, no other
    links = [a.attrs["href"] for a in parse(run_page.text).find(id="alert-list").find_all("a")]
    assert collapse["rollouts_url"] in links


def test_a_resume_takes_the_steps_it_redoes_out_of_the_search(
    session_factory: sessionmaker[Session], explored: Any
) -> None:
    """Resuming from a checkpoint deletes the steps after it; their words leave the index (on
    SQLite the index holds no text of its own), and the steps written again are found."""
    run_id, truth = explored
    late = {r["id"] for r in truth if r["step"] > 3 and _has(r, "gamma")}
    assert late  # the fixture has gamma after step 3
    with session_scope(session_factory) as session:
        store.truncate_after(session, run_id=run_id, step=3)
    _record(session_factory, run_id, random.Random(99), range(4, 6))
    again = _truth(session_factory, run_id)
    expected = sorted(r["id"] for r in again if _has(r, "gamma"))
    with client_for(session_factory) as client:
        rows, total = explorer_pages(client, f"/api/runs/{run_id}/rollouts?q=gamma&limit=50")
    assert sorted(r["id"] for r in rows) == expected and total == len(expected)


@pytest.mark.parametrize("n_tokens", [4, 200])
def test_acompletion_head_is_the_step_viewers_text(n_tokens: int) -> None:
    """The explorer shows a completion's head as the step viewer shows its text: an end-of-turn
    token the text leaves out (text_rule's dropped count) is not shown either (it was:
    `…</tool></assistant>` against `…</tool>`)."""
    from rollout_lens.server.store import arrays
    from rollout_lens.server.store.models import RolloutRow
    from rollout_lens.server.webapp.queries.explorer import completion_head

    texts = {5: "<tool>", 100: "tool_33", 6: "</tool>", 2: "</assistant>"}
    ids = [5, 100, 6, 2]
    rule = arrays.text_rule("<tool>tool_33</tool>", ids, texts)
    assert rule is not None and rule // 8 == 1  # the text drops the closing </assistant>
    head = completion_head(RolloutRow(text_rule=rule, n_tokens=n_tokens), ids, texts)
    if n_tokens == len(ids):  # the whole completion: exactly the viewer's text
        assert head == arrays.rebuild_text(rule, ids, texts) == "<tool>tool_33</tool>"
    else:  # a head of a longer one: its first tokens, cut
        assert head == "<tool>tool_33</tool></assistant>…"
