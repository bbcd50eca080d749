"""What the chart pages say agrees with what they show, in Chromium (issue 31): a page past 20
steps opens smoothed and says so; only a series of 10+ unchanged points folds, and the count
names what folded; a lone point is drawn; a run without steps says so, with no axes; the run
card's window and dates say what they are; the probes' key gives each line's last value."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunStatus
from rollout_lens.server.webapp.app import create_app
from rollout_lens.server.webapp.queries.chart_data import (
    FOLD_MIN_POINTS,
    SMOOTH_PAST_STEPS,
    SMOOTHING,
)

from tests import web_support
from tests.browser.test_browser import ARTIFACTS
from tests.browser.test_browser_charts import _accuracy, _ema, _shot, _shown
from tests.factories import CONTROL_TOKENS, TOOLS, make_rollouts, record_step

pytestmark = pytest.mark.browser

LONG, SHORT = 30, 12  # past SMOOTH_PAST_STEPS and not; SHORT is past FOLD_MIN_POINTS, one bucket


def _create(factory: Any, name: str, steps: int, **columns: Any) -> int:
    config = {"kl_coef": 0.0, "num_iterations": 1, "variant": "patched", "k": 4, "steps": steps}
    with session_scope(factory) as session:
        return store.create_run(
            session,
            name=name,
            model="tiny",
            total_steps=steps,
            group_size=8,
            variant="patched",
            k=4,
            config=config,
            control_tokens=CONTROL_TOKENS,
            **columns,
        ).id


def _record(factory: Any, run_id: int, steps: int) -> None:
    for step in range(1, steps + 1):
        acc = _accuracy(step, 0)
        values = {
            "reward_mean": 0.5 + acc / 2,
            "true_accuracy": acc,
            "format_valid_rate": 1.0,
            "learning_rate": 3e-4,
            "kl": 0.041 if step == 5 else None,  # logged once
        }
        probes = {"probe/open_first/mean": 1.0, "probe/eot_after_open/mean": 2e-6}
        evaluated = {"eval/id": 0.5} if step in (5, 10) else {}  # two evaluations that agree
        record_step(factory, run_id, step, values=values, metrics=probes | evaluated)
    with session_scope(factory) as session:
        store.mark_finished(session, run_id=run_id, status=RunStatus.completed)


def _viewer_run(factory: Any, *, query: bool) -> int:
    """One step of one group; rollout #4 names an unlisted tool in a clean call (text
    pollution, reward 0). Without `query`, a user's rows: no query column."""
    run_id = _create(factory, "viewer" if query else "user run", 1)
    rollouts = make_rollouts(random.Random(3))
    listed = rollouts[0].meta["tool_ids"]
    unlisted = next(t for t in TOOLS if t not in listed)
    polluted = rollouts[4]
    polluted.completion, polluted.vote = f"<tool>{unlisted}</tool>", unlisted
    polluted.format_state, polluted.format_valid = "text_pollution", False
    polluted.verifier_reward = polluted.true_score = 0.0
    if not query:
        for r in rollouts:
            r.meta = {}
    record_step(factory, run_id, 1, values={"reward_mean": 0.5}, rollouts=rollouts)
    return run_id


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, int]]]:
    data_dir = tmp_path_factory.mktemp("words")
    url = f"sqlite:///{data_dir / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    runs = {"long": _create(factory, "long run", LONG), "short": _create(factory, "short", SHORT)}
    _record(factory, runs["long"], LONG)
    _record(factory, runs["short"], SHORT)
    runs["viewer"] = _viewer_run(factory, query=True)
    runs["user"] = _viewer_run(factory, query=False)
    runs["starting"] = _create(factory, "starting run", 5)
    with session_scope(factory) as session:
        store.set_phase(session, run_id=runs["starting"], phase="starting: loading the model")
    app = create_app(Settings(database_url=url, data_dir=data_dir, lost_after_seconds=3600))
    with web_support.serve_app(app) as base:
        yield base, runs
    engine.dispose()


@pytest.fixture
def page(browser: Browser, served: tuple[str, dict[str, int]]) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 900}, base_url=served[0])
    context.set_default_timeout(10_000)
    errors: list[str] = []
    tab = context.new_page()
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    # A form that does not parse answers 422 (as the API does): Chromium logs that status.
    tab.on(
        "console",
        lambda msg: (
            errors.append(msg.text)
            if msg.type == "error" and "status of 422" not in msg.text
            else None
        ),
    )
    yield tab
    context.close()
    assert errors == []


def _open(page: Page, path: str) -> None:
    page.goto(path)
    page.wait_for_selector("body[data-charts-ready]")


def test_a_page_past_its_step_count_opens_smoothed_and_says_so(
    page: Page, served: tuple[str, dict[str, int]]
) -> None:
    runs = served[1]
    accuracy = [_accuracy(s, 0) for s in range(1, LONG + 1)]
    _open(page, f"/runs/{runs['long']}")
    assert page.locator("#smoothing").input_value() == str(SMOOTHING)
    note = page.locator("#smoothing-note")
    assert note.is_visible() and f"past {SMOOTH_PAST_STEPS} steps" in note.inner_text()
    assert _shown(page, "reward", "true_accuracy") == pytest.approx(_ema(accuracy, SMOOTHING))
    assert "smooth=" not in page.url  # the default, not a choice: nothing to share
    _shot(page, "words-run-opens-smoothed")

    _open(page, f"/compare?runs={runs['long']},{runs['short']}")
    assert page.locator("#smoothing-note").is_visible()
    assert page.locator("#smoothing").input_value() == str(SMOOTHING)
    _shot(page, "words-compare-opens-smoothed")

    # The reader's choice wins, 0 included, and a reload keeps it.
    _open(page, f"/runs/{runs['long']}")
    page.locator("#smoothing").fill("0")
    page.wait_for_function("() => document.body.dataset.view === '0:0'")
    assert "smooth=0" in page.url and not page.locator("#smoothing-note").is_visible()
    page.reload()
    page.wait_for_selector("body[data-charts-ready]")
    assert _shown(page, "reward", "true_accuracy") == accuracy

    # A short run opens raw; an evaluation is never smoothed.
    _open(page, f"/runs/{runs['short']}")
    assert page.locator("#smoothing").input_value() == "0"
    assert not page.locator("#smoothing-note").is_visible()


def test_only_a_series_of_enough_unchanged_points_folds(
    page: Page, served: tuple[str, dict[str, int]]
) -> None:
    _open(page, f"/runs/{served[1]['short']}")
    _shot(page, "words-short-run")

    def folded(fid: str) -> bool:
        classes = page.locator(f'figure[data-figure="{fid}"]').get_attribute("class") or ""
        return "flat" in classes.split()

    # 12 unchanged points of the learning rate fold; one filling bucket and two agreeing
    # evaluations say nothing yet.
    assert folded("s-learning_rate") and SHORT >= FOLD_MIN_POINTS
    assert not folded("buckets")
    evals = page.evaluate(
        """() => [...document.querySelectorAll("figure")].filter((f) => f.querySelector(".plot")
            && (f.querySelector(".plot").data || []).some((t) => t.meta && t.meta.series === "eval/id"))
            .map((f) => f.classList.contains("flat"))"""
    )
    assert evals == [False]
    count = page.locator("#flat-count").inner_text()
    titles = page.evaluate(
        """() => [...document.querySelectorAll("figure.flat .chart-title")]
            .map((t) => t.firstChild.textContent.trim())"""
    )
    assert count.startswith(f"{len(titles)} chart")
    assert all(t in count for t in titles[:4]), (count, titles)
    assert f"at least {FOLD_MIN_POINTS} points" in count


def test_a_lone_point_is_drawn_and_the_probes_key_gives_last_values(
    page: Page, served: tuple[str, dict[str, int]]
) -> None:
    _open(page, f"/runs/{served[1]['short']}")
    kl = page.evaluate(
        """() => document.getElementById("fig-s-kl").data.find((t) => t.meta && t.meta.part === "y")"""
    )
    assert [v for v in kl["y"] if v is not None] == [0.041] and kl["mode"] == "lines+markers"
    assert page.locator('[data-last-of="s-kl"]').inner_text() == "· last 0.0410"
    names = page.evaluate(
        """() => document.getElementById("fig-probes").data
            .filter((t) => t.meta && t.meta.part === "y").map((t) => t.name)"""
    )
    assert sorted(names) == ["end-of-turn after open tag · < 0.001", "open tag first · 1"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator('figure[data-figure="probes"]').screenshot(
        path=str(ARTIFACTS / "words-probes.png")
    )


def test_a_run_before_its_first_step_says_so_without_axes_or_dashes(
    page: Page, served: tuple[str, dict[str, int]]
) -> None:
    _open(page, f"/runs/{served[1]['starting']}")
    _shot(page, "words-starting-run")
    figure = page.locator('figure[data-figure="reward"]')
    assert figure.get_attribute("data-empty") == "no steps yet"
    assert "no-data" in (figure.get_attribute("class") or "")
    assert figure.locator(".plot").evaluate("(el) => getComputedStyle(el).visibility") == "hidden"
    assert page.locator("#run-live").inner_text() == "Starting: loading the model"
    card = page.locator("#run-card").inner_text()
    assert "not yet (starting: loading the model)" in card
    assert "known once training starts" in card
    assert "true acc. · last 25" in card.lower()


def test_the_run_card_window_says_how_many_steps_it_holds(
    page: Page, served: tuple[str, dict[str, int]]
) -> None:
    _open(page, f"/runs/{served[1]['short']}")
    facts = page.locator("#run-card dl.facts").inner_text().lower()
    assert f"true acc. · last {SHORT}" in facts and f"reward · last {SHORT}" in facts
    assert "last 25" not in facts
    _open(page, f"/runs/{served[1]['long']}")
    assert "true acc. · last 25" in page.locator("#run-card dl.facts").inner_text().lower()


def test_a_group_page_says_why_a_state_is_bad_and_where_it_goes(
    page: Page, served: tuple[str, dict[str, int]]
) -> None:
    run_id = served[1]["viewer"]
    page.goto(f"/runs/{run_id}/steps/1/groups/0#r4")
    page.wait_for_selector("#group-nav")
    panel = page.locator(".rollout-stats >> visible=true")
    reason = panel.locator("[data-reason]").inner_text()
    assert reason.startswith("names tool_") and reason.endswith("which the prompt does not list")
    assert panel.locator(".state-badge").inner_text() == "text_pollution"
    nav = page.locator("#group-nav").inner_text()
    assert "No earlier group" in nav and "No later group" in nav
    assert "Step overview · 1 group" in nav and "[ Group" not in nav and "Group ]" not in nav
    assert page.locator(".group-card .query").inner_text() == "17 * 38"
    _shot(page, "words-group-page")

    page.goto(f"/runs/{served[1]['user']}/steps/1/groups/0")
    page.wait_for_selector("#group-nav")
    shown = page.locator(".group-card .prompt-end").inner_text()
    assert shown != "—" and "Reply with only <tool>ID</tool>" in shown
    assert "no query column" in page.locator("#prompt-end-note").inner_text()
    _shot(page, "words-user-group-page")


def test_a_bad_explorer_value_keeps_the_explorer_in_chromium(
    page: Page, served: tuple[str, dict[str, int]]
) -> None:
    run_id = served[1]["viewer"]
    page.goto(f"/runs/{run_id}/rollouts")
    page.fill('input[name="steps"]', "abc")
    page.fill('input[name="group"]', "0")
    page.click('#explorer-filters button[type="submit"]')
    page.wait_for_selector("#err-steps")
    assert page.url.endswith(f"/runs/{run_id}/rollouts?steps=abc&group=0")  # no empty field
    assert page.locator('input[name="steps"]').get_attribute("aria-invalid") == "true"
    assert "a range A:B" in page.locator("#err-steps").inner_text()
    assert page.locator('input[name="group"]').input_value() == "0"
    _shot(page, "words-explorer-bad-value")
    page.fill('input[name="steps"]', "1")
    page.click('#explorer-filters button[type="submit"]')
    page.wait_for_selector("#rollouts-table")
    assert page.url.endswith("?steps=1&group=0")
