"""A run whose model is being built says so, with the build's progress, on its page and in the
runs list, live; the line goes once it trains."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.webapp.app import create_app
from sqlalchemy.orm import Session, sessionmaker

from tests import web_support
from tests.browser.test_browser import ARTIFACTS
from tests.factories import CONTROL_TOKENS, record_step

pytestmark = pytest.mark.browser

BUILDING = "building the multi-turn model: warm-up step {} of 800 (about 3 minutes on an idle core)"


@pytest.fixture
def served(tmp_path: Any) -> Iterator[tuple[str, sessionmaker[Session], int]]:
    url = f"sqlite:///{tmp_path / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    with session_scope(factory) as session:
        run_id = store.create_run(
            session,
            name="multi-turn first launch",
            model="tiny",
            total_steps=10,
            group_size=4,
            config={"turns": "multi"},
        ).id
        assert store.claim_run(session, run_id=run_id, task_id="t-1")
        store.set_phase(session, run_id=run_id, phase=BUILDING.format(100))
    app = create_app(Settings(database_url=url, data_dir=tmp_path, lost_after_seconds=3600))
    with web_support.serve_app(app) as base:
        yield base, factory, run_id
    engine.dispose()


@pytest.fixture
def page(browser: Browser, served: tuple[str, Any, int]) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 900}, base_url=served[0])
    context.set_default_timeout(15_000)
    errors: list[str] = []
    tab = context.new_page()
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    yield tab
    context.close()
    assert errors == []


def test_a_run_whose_model_is_being_built_says_so_live(
    page: Page, served: tuple[str, sessionmaker[Session], int]
) -> None:
    _, factory, run_id = served
    page.goto(f"/runs/{run_id}")
    live = page.locator("#run-live")
    assert live.inner_text() == BUILDING.format(100)[:1].upper() + BUILDING.format(100)[1:]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "run-building-model.png"))

    # The build goes on: the page follows it without a reload.
    with session_scope(factory) as session:
        store.set_phase(session, run_id=run_id, phase=BUILDING.format(500))
    page.wait_for_function(
        "() => document.getElementById('run-live').textContent.includes('warm-up step 500 of 800')"
    )

    page.goto("/")
    row = page.locator(f'tr[data-run-id="{run_id}"]')
    assert BUILDING.format(500) in row.locator('[data-field="phase"]').inner_text()
    page.screenshot(path=str(ARTIFACTS / "runs-building-model.png"))

    # Training starts, then steps come: the phase line goes from the list and the page.
    with session_scope(factory) as session:
        store.mark_running(
            session, run_id=run_id, worker_host="here", device="cpu", control_tokens=CONTROL_TOKENS
        )
    record_step(factory, run_id, 1, values={"reward_mean": 0.5, "true_accuracy": 0.25})
    page.wait_for_function(
        f"""() => document.querySelector('tr[data-run-id="{run_id}"] [data-field="phase"]')
            .textContent === ''"""
    )
    page.goto(f"/runs/{run_id}")
    assert live.inner_text().startswith("Step 1 of 10")


def test_the_launch_form_warns_of_a_build_for_the_chosen_turns(
    browser: Browser, tmp_path: Any
) -> None:
    url = f"sqlite:///{tmp_path / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    note = "The first multi-turn run on this machine builds the multi-turn model before its first step (about 3 minutes on an idle core, longer on a busy one); later runs reuse it."
    app = create_app(
        Settings(database_url=url, data_dir=tmp_path), model_builds=lambda: {"multi": note}
    )
    with web_support.serve_app(app) as base:
        context = browser.new_context(viewport={"width": 1400, "height": 900}, base_url=base)
        page = context.new_page()
        page.goto("/runs/new")
        warning = page.locator("#model-build-multi")
        budget = page.locator("#help-max_completion_tokens .field-default")
        assert not warning.is_visible() and budget.inner_text() == "default 8"
        page.locator("#f-turns").select_option("multi")
        assert warning.is_visible() and warning.inner_text() == note
        assert budget.inner_text() == "default 128"
        assert page.locator("#f-max_completion_tokens").input_value() == "128"
        page.screenshot(path=str(ARTIFACTS / "launch-form-build-warning.png"))
        context.close()
    engine.dispose()
