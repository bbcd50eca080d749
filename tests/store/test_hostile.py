"""Hostile text in everything a run records — name, config, prompt, completion, vote, query,
control tokens: HTML, scripts, template syntax, control characters, NUL, lone surrogates, 1 MB —
is stored (SQLite and PostgreSQL) and shown inert on every page, parsed (in Chromium:
tests/browser/test_browser_hostile.py)."""

from __future__ import annotations

import io
import json
import random

import pyarrow.parquet as pq
from fastapi.testclient import TestClient
from rollout_lens.server import store
from rollout_lens.server.core.records import RolloutRecord
from rollout_lens.server.core.textsafe import storable
from rollout_lens.server.exchange.schema import META_RUN
from rollout_lens.server.store import prompt_texts
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import PromptRow
from rollout_lens.server.store.serialize import completion_ids, completion_text
from rollout_lens.server.webapp import queries
from rollout_lens.server.webapp.queries import JSON_TOKENS
from rollout_lens.server.webapp.queries.budget import SHOWN_CHARS
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_rollouts
from tests.web_support import Node, parse

# Each payload sets window.__pwned (and opens a dialog) if it ever runs.
SCRIPT = "<script>window.__pwned='script';alert(1)</script>"
IMG = "<img src=x onerror=\"window.__pwned='img';alert(2)\">"
TEMPLATES = "{{ 7*7 }}{% if true %}jinja{% endif %}${7*7}"
CONTROL = "\x07\x1b[31m\x7f"
UNSTORABLE = "\x00\ud800"  # NUL (PostgreSQL refuses it) and a lone surrogate (UTF-8 cannot hold it)
HOSTILE = f"{SCRIPT}{IMG}</textarea></pre>{TEMPLATES}{CONTROL}{UNSTORABLE}<b>end</b>"
VOTE = "<img src=x onerror=alert(4)>{{7*7}}"  # votes and targets are 64 characters at most
TOKEN = "<img src=x onerror=alert(5)>"  # a control token a user's tokenizer has
CONTROL_TOKENS = ("<tool>", "</tool>", TOKEN)
BIG = (HOSTILE * (2**20 // len(HOSTILE) + 1))[: 2**20]


def hostile_rollouts(completion: str) -> list[RolloutRecord]:
    rollouts = make_rollouts(random.Random(5), completion=completion)
    for r in rollouts:
        r.prompt = f"<user>{HOSTILE}</user><assistant>"
        r.vote = VOTE
        r.meta = r.meta | {"query": HOSTILE, "tool_ids": [VOTE], "hint": HOSTILE}
        r.control_probs = {t: [0.5] * len(r.completion_ids) for t in CONTROL_TOKENS}
    return rollouts


def record_hostile_run(factory: sessionmaker[Session], *, completion: str = HOSTILE) -> int:
    """A run whose every text is hostile, with two steps (through store.record_step)."""
    with session_scope(factory) as session:
        run_id = store.create_run(
            session,
            name=HOSTILE[:190],
            model=IMG,
            total_steps=2,
            group_size=8,
            config={"<b>key</b>": HOSTILE, "nested": {IMG: [HOSTILE, TEMPLATES]}},
            control_tokens=CONTROL_TOKENS,
            notes=[HOSTILE],
        ).id
    for step in (1, 2):
        metrics = {f"ctrl/{TOKEN}/mean": 0.5}
        with session_scope(factory) as session:
            from rollout_lens.server.core.records import StepRecord

            store.record_step(
                session,
                run_id=run_id,
                record=StepRecord(
                    step=step,
                    rollout_step=step,
                    values={"reward_mean": 0.5, "true_accuracy": 0.5},
                    rollouts=hostile_rollouts(completion),
                    metrics=metrics,
                ),
                control_tokens=CONTROL_TOKENS,
            )
    return run_id


def assert_inert(html: str, url: str) -> Node:
    """No element, attribute or script of the payload made it into the page as markup."""
    tree = parse(html)
    for script in tree.find_all("script"):
        assert script.attrs.get("src", "").startswith("/static/") or (
            script.attrs.get("type") == "application/json"
        ), url
        assert "__pwned" not in script.text or script.attrs.get("type") == "application/json", url
        assert "</script" not in script.text.lower(), url
    for node in tree.iter():
        assert not any(name.startswith("on") for name in node.attrs), (url, node.tag, node.attrs)
        assert node.tag not in ("textarea", "b"), (url, node.tag)
        assert node.tag != "img" or node.attrs.get("src", "").startswith("/static/"), url
    return tree


def test_hostile_text_is_stored_and_shown_inert(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    run_id = record_hostile_run(session_factory)
    other = record_hostile_run(session_factory)
    clean = storable(HOSTILE)
    assert clean.count("\ufffd") == 2 and "\x00" not in clean  # NUL and the surrogate, replaced

    pages = {
        "runs": "/",
        "run": f"/runs/{run_id}",
        "step": f"/runs/{run_id}/steps/1",
        "card": f"/runs/{run_id}/steps/1/card",
        "compare": f"/compare?runs={run_id},{other}",
        "search": "/?q=%3Cscript%3E",
    }
    trees = {}
    for name, url in pages.items():
        response = client.get(url)
        assert response.status_code == 200, (url, response.text[:500])
        trees[name] = assert_inert(response.text, url)

    step = trees["step"]
    completion = step.find("pre", cls="completion")
    # As text, control characters shown as pictures, the unstorable as U+FFFD.
    assert completion.text.startswith(SCRIPT + IMG + "</textarea></pre>" + TEMPLATES + "␇␛")
    assert "\ufffd\ufffd<b>end</b>" in completion.text
    assert step.find("p", cls="query").text.startswith(SCRIPT)
    assert TEMPLATES in step.find("pre", cls="prompt-text").text
    assert VOTE in step.find("span", cls="vote-id").text
    ctrl = step.find("table", cls="ctrl")
    # control tokens are named as token cells are drawn: their spaces shown as ·
    names = [t.replace(" ", "·") for t in CONTROL_TOKENS]
    assert [th.text for th in ctrl.find("tbody").find_all("th")] == ["sampled", *names]
    assert HOSTILE[:60] in trees["runs"].find("td", cls="name").text
    assert TEMPLATES in trees["run"].find("details", cls="config").text
    assert trees["card"].find("td", cls="completion-cell").text.startswith(SCRIPT)

    # The JSON twins carry the same text, as JSON strings (storable, so they encode).
    api = client.get(f"/api/runs/{run_id}/steps/1/groups/0").json()
    rollout = api["rollouts"][0]
    assert (
        rollout["completion"] == clean and rollout["prompt"] == f"<user>{clean}</user><assistant>"
    )
    assert rollout["meta"]["query"] == clean
    run = client.get(f"/api/runs/{run_id}").json()["run"]
    assert run["name"] == storable(HOSTILE[:190]) and run["notes"] == [clean]
    assert run["config"]["nested"][IMG] == [clean, TEMPLATES]
    assert client.get(f"/api/compare?runs={run_id},{other}").status_code == 200
    assert client.get("/api/runs").status_code == 200
    # Stored clean, not only shown clean: no NUL or lone surrogate (nor their JSON escapes).
    engine = session_factory.kw["bind"]
    cast = "::text" if engine.dialect.name == "postgresql" else ""
    with engine.connect() as conn:
        stored = [
            str(value)
            for sql in (
                f"SELECT name, config{cast}, notes{cast} FROM runs",
                f"SELECT vote, own_meta{cast} FROM rollouts",
                f"SELECT data{cast} FROM facts",
            )
            for row in conn.exec_driver_sql(sql)
            for value in row
        ]
    with session_scope(session_factory) as session:  # completions and prompts: compressed
        prompt_ids = session.scalars(select(PromptRow.id)).all()
        stored += prompt_texts.texts(session, prompt_ids).values()
        texts = store.token_texts(session, run_id=run_id)
        stored += [
            completion_text(r, completion_ids(r), texts)
            for r, _ in store.iter_rollouts(session, run_id=run_id)
        ]
    assert any("\ufffd" in v or "\\ufffd" in v for v in stored)
    for bad in ("\x00", "\ud800", "\\u0000", "\\ud800"):
        assert not any(bad in v for v in stored), bad


def test_a_1_mb_completion_is_cut_on_pages_and_whole_in_the_json(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    run_id = record_hostile_run(session_factory, completion=BIG)
    other = record_hostile_run(session_factory)
    page = client.get(f"/runs/{run_id}/steps/1")
    tree = assert_inert(page.text, "step")
    assert len(page.content) < 2**20  # eight 1 MB completions, and the page is not 8 MB
    panel = tree.by_id("rollout-0")
    completion = panel.find("pre", cls="completion").text
    assert completion == storable(BIG)[:SHOWN_CHARS].replace("\x07", "␇").replace(
        "\x1b", "␛"
    ).replace("\x7f", "␡")
    note = panel.find("p", cls="clip-note")
    assert "Shown 20,000 of 1,048,576 characters" in note.text
    assert note.find("a").attrs["href"] == f"/api/runs/{run_id}/steps/1/groups/0?offset=0&limit=1"
    card = assert_inert(client.get(f"/compare?runs={run_id},{other}").text, "compare")
    assert "of 1,048,576 characters" in card.find("td", cls="completion-cell").text
    # the JSON of that one rollout: as much as a 2 MB answer holds, and how much there is
    full = client.get(note.find("a").attrs["href"]).json()
    (one,) = full["rollouts"]
    assert one["completion"] == storable(BIG)[: queries.JSON_TEXT_BUDGET]
    assert one["completion_chars"] == len(storable(BIG))


def test_a_long_completion_shows_its_first_tokens(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    with session_scope(session_factory) as session:
        run_id = store.create_run(
            session, name="long", model="m", total_steps=1, group_size=8, control_tokens=["<t>"]
        ).id
    n = 100_000
    rollouts = make_rollouts(random.Random(1))
    for r in rollouts:
        r.completion_ids = list(range(n))
        r.token_logprobs = [-0.5] * n
        r.control_probs = {"<t>": [0.25] * n}
    with session_scope(session_factory) as session:
        from rollout_lens.server.core.records import StepRecord

        store.record_step(
            session,
            run_id=run_id,
            record=StepRecord(step=1, rollout_step=1, values={}, rollouts=rollouts),
            control_tokens=["<t>"],
        )
    tree = parse(client.get(f"/runs/{run_id}/steps/1").text)
    panel = tree.by_id("rollout-3")
    cells = panel.find("div", cls="tokens").find_all("span", role="listitem")
    assert len(cells) == 256  # 2,048 a page over 8 rollouts
    assert cells[255].attrs["title"].startswith("#255 · id 255 · p=0.607")
    assert "Shown the first 256 of 100,000 tokens" in panel.find("p", cls="clip-note").text
    assert len(panel.find("table", cls="ctrl").find("thead").find_all("th")) == 1 + 64
    link = panel.find("p", cls="clip-note").find("a").attrs["href"]
    assert link == f"/api/runs/{run_id}/steps/1/groups/0?offset=3&limit=1&max_tokens={n}"
    # one rollout's JSON: as many positions as a 2 MB answer holds, and how many there are
    (whole,) = client.get(link).json()["rollouts"]
    assert whole["index"] == 3 and whole["completion_ids"] == list(range(queries.JSON_POSITIONS))
    assert whole["tokens_total"] == n
    cut = client.get(f"/api/runs/{run_id}/steps/1/groups/0").json()["rollouts"][3]
    assert len(cut["completion_ids"]) == JSON_TOKENS and cut["tokens_total"] == n


def test_unstorable_text_written_before_the_cleaning_still_renders(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    """A lone surrogate already in a JSON column (as `\\ud800`, which both databases accept)
    shows as U+FFFD rather than failing the page with a 500."""
    run_id = record_hostile_run(session_factory)
    raw = session_factory.kw["bind"].raw_connection()  # past the engine's cleaning
    try:
        cursor = raw.cursor()
        marker = "%s" if "postgresql" in str(session_factory.kw["bind"].url) else "?"
        cursor.execute(
            f"UPDATE runs SET config = {marker}, notes = {marker} WHERE id = {run_id}",
            ('{"legacy": "a\\ud800b"}', '["n\\udc00"]'),
        )
        raw.commit()
    finally:
        raw.close()
    for url in ("/", f"/runs/{run_id}/steps/1", f"/api/compare?runs={run_id},{run_id + 1}"):
        assert client.get(url).status_code in (200, 404), url
    page = client.get(f"/runs/{run_id}")
    assert page.status_code == 200 and "n\ufffd" in parse(page.text).text  # the note
    api = client.get(f"/api/runs/{run_id}")
    assert api.status_code == 200 and api.json()["run"]["config"] == {"legacy": "a\ufffdb"}
    # the downloads too: whole, with U+FFFD where the surrogate was
    lines = client.get(f"/api/runs/{run_id}/export").content.decode("utf-8").splitlines()
    assert json.loads(lines[0])["config"] == {"legacy": "a\ufffdb"}
    assert json.loads(lines[-1])["kind"] == "end"
    parquet = client.get(f"/api/runs/{run_id}/export?format=parquet")
    header = pq.read_schema(io.BytesIO(parquet.content)).metadata[META_RUN]
    assert json.loads(header)["notes"] == ["n\ufffd"]
    steps = client.get(f"/api/runs/{run_id}/export?what=steps&format=csv")
    assert steps.status_code == 200 and steps.text.startswith("step,")
