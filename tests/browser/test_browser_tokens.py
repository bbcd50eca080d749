"""The step viewer shows a real model's tokens as text, in Chromium: SmolLM2-135M-Instruct's
byte-level pieces ('Ġcan', 'Ċ', 'ãģ') read as the text each contributes, a Japanese character
or an emoji split over tokens is one cell with their ids in its title, the control-token table
reads 'Ġ<' as ' <', and a tag in the text stays text. Screenshots go to
$ROLLOUT_LENS_TEST_ARTIFACTS as stepview-tokens-*.png."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.webapp.app import create_app

from tests.real_model import real_tokenizer, record_real_run
from tests.web_support import serve_app

pytest.importorskip("playwright.sync_api")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.browser

ARTIFACTS = Path(
    os.environ.get("ROLLOUT_LENS_TEST_ARTIFACTS")
    or Path(__file__).resolve().parents[2] / "test-artifacts"
)
RAW = re.compile("[\u0100-\u0143]")  # byte-level BPE's remapped characters: Ġ, Ċ, ĵ, …


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Any]]:
    real = real_tokenizer()
    data_dir = tmp_path_factory.mktemp("tokens")
    url = f"sqlite:///{data_dir / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    run_id = record_real_run(make_session_factory(engine), real)
    app = create_app(Settings(database_url=url, data_dir=data_dir, lost_after_seconds=3600))
    with serve_app(app) as base:
        yield base, run_id, real
    engine.dispose()


@pytest.fixture
def page(browser: Any, served: tuple[str, int, Any]) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=served[0])
    context.set_default_timeout(10_000)
    errors: list[str] = []
    page = context.new_page()
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    yield page
    context.close()
    assert errors == []


def _cells(page: Any, rollout: int) -> list[tuple[str, str]]:
    """(text as drawn, title) of each token cell of a rollout's tab panel."""
    cells = page.locator(f"#rollout-{rollout} .tokens [role=listitem]")
    return [(cells.nth(i).inner_text(), cells.nth(i).get_attribute("title")) for i in range(cells.count())]  # fmt: skip


def test_the_step_viewer_shows_a_real_models_tokens_as_text(
    page: Any, served: tuple[str, int, Any]
) -> None:
    _, run_id, real = served
    page.goto(f"/runs/{run_id}/steps/1")
    # #0: English words with their spaces (drawn ·), newlines (↵), the end of turn
    english = _cells(page, 0)
    assert [t for t, _ in english[:4]] == ["Sure", ",", "·I", "·can"]
    assert [t for t, _ in english[7:10]] == ["↵", "↵", "<"] and english[-1][0] == "<|im_end|>"
    assert not any(RAW.search(t) for t, _ in english)
    # the control-token table: a column a cell, its rows named as text ('Ġ<' reads ' <')
    table = page.locator("#rollout-0 table.ctrl")
    heads = table.locator("tbody th[scope=row]")
    assert [heads.nth(i).inner_text() for i in range(heads.count())] == ["sampled", "·<", "<|im_end|>"]  # fmt: skip
    assert table.locator("thead th").nth(1).inner_text() == "Sure"
    # the reply format in the text is text, not markup
    assert page.locator("#rollout-0 .tokens tool").count() == 0
    page.screenshot(path=str(_artifact("english")), full_page=True)

    # #1: Japanese; a character over two or three tokens is one cell with their ids
    page.locator("#tab-1").click()
    japanese = _cells(page, 1)
    ids = real.encode("はい、予定を入れます。ツールは tool_03 です。", add_special_tokens=False)
    assert "".join(t for t, _ in japanese[:-1]).replace("·", " ") == real.decode(ids)
    merged = [(t, title) for t, title in japanese if title.split(" · ")[1].startswith("ids ")]
    assert merged, "no character was split over tokens"
    for text, title in merged:
        assert (
            len(text.removeprefix("·")) == 1
            and "one character over" in title
            and "p is the product" in title
        )
    assert not any(RAW.search(t) for t, _ in japanese)
    # every token is shown: merged cells count their tokens, not themselves
    assert page.locator("#rollout-1 .clip-note").count() == 0
    page.locator("#rollout-1").screenshot(path=str(_artifact("japanese")))

    # #2: an emoji over three tokens is one cell ' 🎉' (its space drawn ·)
    page.locator("#tab-2").click()
    emoji = _cells(page, 2)
    party = next(title for text, title in emoji if text == "·🎉")
    assert re.match(r"#\d+–\d+ · ids \d+, \d+, \d+ · p=", party)
    # a ZWJ sequence is its characters, the joiner drawn (it draws nothing itself)
    texts = [t for t, _ in emoji]
    at = texts.index("·👩")
    assert texts[at : at + 3] == ["·👩", "U+200D", "💻"]
    page.locator("#rollout-2").screenshot(path=str(_artifact("emoji")))


def test_the_json_twin_gives_texts_and_pieces(page: Any, served: tuple[str, int, Any]) -> None:
    _, run_id, real = served
    group = page.request.get(f"/api/runs/{run_id}/steps/1/groups/0").json()
    for r in group["rollouts"]:
        ids = r["completion_ids"]
        assert "".join(r["tokens"]) == real.decode(ids, skip_special_tokens=False)
        assert r["token_pieces"] == real.convert_ids_to_tokens(ids)


def _artifact(name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / f"stepview-tokens-{name}.png"
