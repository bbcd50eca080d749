"""Hostile runs (tests/store/test_hostile.py's payloads) in Chromium: no script of a payload runs,
no dialog opens, no JS error, and the pages' keys and controls work as usual."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.webapp.app import create_app

from tests import web_support
from tests.factories import record_step
from tests.store.test_hostile import (
    BIG,
    HOSTILE,
    IMG,
    SCRIPT,
    TEMPLATES,
    hostile_rollouts,
    record_hostile_run,
)


@dataclass
class Served:
    url: str
    runs: dict[str, int]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The app under uvicorn on an SQLite file holding two hostile runs (one with 1 MB texts)."""
    data_dir = tmp_path_factory.mktemp("hostile")
    url = f"sqlite:///{data_dir / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    runs = {
        "hostile": record_hostile_run(factory),
        "big": record_hostile_run(factory, completion=BIG),
    }
    record_step(factory, runs["hostile"], 3, rollouts=hostile_rollouts(HOSTILE))
    settings = Settings(database_url=url, data_dir=data_dir, lost_after_seconds=3600)
    with web_support.serve_app(create_app(settings)) as base:
        yield Served(base, runs)
    engine.dispose()


@pytest.mark.browser
def test_no_payload_runs_in_chromium(served: Served, browser: Any) -> None:
    """Every page with hostile runs, in a real browser: no script of the payload runs, no dialog
    opens, no JS error; tabs, keys and the compare step control work as usual."""
    dialogs: list[str] = []
    errors: list[str] = []
    context = browser.new_context(base_url=served.url)
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    hostile, big = served.runs["hostile"], served.runs["big"]
    try:
        for path in (
            "/",
            f"/runs/{hostile}",
            f"/runs/{hostile}/steps/1",
            f"/runs/{big}/steps/2",
            f"/compare?runs={hostile},{big}",
        ):
            page.goto(path)
            page.wait_for_load_state("networkidle")
            if path.startswith(f"/runs/{hostile}") and "steps" not in path:
                page.wait_for_selector("body[data-charts-ready]")
            if "/steps/" in path:
                for key in "1234567":
                    page.keyboard.press(key)
                assert page.locator("#rollout-7").is_visible()
                text = page.locator("#rollout-7 pre.completion").inner_text()
                assert text.startswith(SCRIPT + IMG), path
                with page.expect_navigation():
                    page.keyboard.press("ArrowRight" if path.endswith("/1") else "ArrowLeft")
                page.wait_for_load_state("networkidle")
                assert page.locator("#rollout-0 pre.completion").inner_text().startswith(SCRIPT)
            if path.startswith("/compare"):
                page.wait_for_selector("body[data-charts-ready]")
                page.locator("#cmp-prev").click()  # step 1's cards, swapped in by compare.js
                page.wait_for_selector(f".step-card[data-run='{hostile}'][data-step='1']")
                assert TEMPLATES in page.locator(".pair-body").first.inner_text()
            assert page.evaluate("window.__pwned") is None, path
            assert page.locator("img[src=x]").count() == 0, path
    finally:
        context.close()
    assert dialogs == [] and errors == []
