"""The dashboard in a real browser: Playwright driving Debian's Chromium, with no network.

Screenshots of the runs, run, step viewer and compare pages go to $ROLLOUT_LENS_TEST_ARTIFACTS
(default: test-artifacts/ in the repository root).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Dialog, Page, Route
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunStatus
from rollout_lens.server.webapp.app import create_app
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_groups, make_rollouts, make_run, record_step
from tests.web_support import (
    COLLAPSE_STEP,
    HINT,
    PROBE_SPIKE_STEP,
    record_collapse_run,
    record_supervised_run,
    serve_app,
)

playwright = pytest.importorskip("playwright.sync_api")
uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.browser

XSS = "<script>alert(1)</script></textarea>{{7*7}}\x07"
ARTIFACTS = Path(
    os.environ.get("ROLLOUT_LENS_TEST_ARTIFACTS")
    or Path(__file__).resolve().parents[2] / "test-artifacts"
)


@dataclass
class Served:
    url: str
    factory: sessionmaker[Session]
    runs: dict[str, int] = field(default_factory=dict)


GROUPS = 12


def _groups_run(factory: sessionmaker[Session]) -> int:
    """Two steps of GROUPS groups × 8 rollouts of 40 tokens (tests.factories.make_groups)."""
    run_id = make_run(factory, steps=0, name="many groups", prompts_per_step=GROUPS)
    for step in (1, 2):
        rollouts = make_groups(random.Random(step), groups=GROUPS, tokens=40)
        record_step(factory, run_id, step, values={"reward_mean": 0.5}, rollouts=rollouts)
    return run_id


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The app under uvicorn on a loopback port, on an SQLite file with four runs."""
    data_dir = tmp_path_factory.mktemp("browser")
    url = f"sqlite:///{data_dir / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    runs = {
        "patched": make_run(
            factory, steps=60, seed=1, name="patched k=4", status=RunStatus.completed
        ),
        "leaky": make_run(
            factory, steps=60, seed=2, listed=64, name="leaky 64 tools", status=RunStatus.completed
        ),
        "xss": make_run(
            factory, steps=3, seed=3, completion=XSS, name="<img src=x onerror=alert(2)>"
        ),
        "live": make_run(
            factory, steps=8, seed=4, name="live run", total_steps=20, status=RunStatus.running
        ),
        "collapse": record_collapse_run(factory),
        "supervised": record_supervised_run(factory),
        "groups": _groups_run(factory),
    }
    # data_dir: where a launch from the form would queue (none here launches)
    # lost_after: the factories' "running" runs have no worker beating for them
    app = create_app(Settings(database_url=url, data_dir=data_dir, lost_after_seconds=3600))
    with serve_app(app) as base:
        yield Served(base, factory, runs)
    engine.dispose()


@dataclass
class Tab:
    """A page plus what it must never do: raise a JS error, open a dialog, leave loopback."""

    page: object
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    offsite: list[str] = field(default_factory=list)


@pytest.fixture
def tab(browser: Browser, served: Served) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1440, "height": 900}, base_url=served.url)
    context.set_default_timeout(10_000)
    state = Tab(None)

    def on_dialog(dialog: Dialog) -> None:
        state.dialogs.append(dialog.message)
        dialog.dismiss()

    def watch(page: Page) -> None:
        page.on("pageerror", lambda exc: state.errors.append(str(exc)))
        page.on(
            "console", lambda msg: state.errors.append(msg.text) if msg.type == "error" else None
        )
        page.on("dialog", on_dialog)

    def offline(route: Route) -> None:
        if route.request.url.startswith(served.url):
            route.continue_()
        else:
            state.offsite.append(route.request.url)
            route.abort()

    context.route("**/*", offline)
    context.on("page", watch)
    state.page = context.new_page()
    yield state
    context.close()
    assert state.errors == [] and state.dialogs == [] and state.offsite == []


def _shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _traces(page: Page, figure: str) -> int:
    return int(page.locator(f"#fig-{figure} .scatterlayer .trace").count())


def _point(page: Page, figure: str, series: str, step: int) -> tuple[float, float]:
    """Where on screen Plotly drew `series` at `step`."""
    return page.evaluate(
        """([figure, series, step]) => {
            const el = document.getElementById(`fig-${figure}`);
            const fl = el._fullLayout, box = el.getBoundingClientRect();
            const trace = el.data.find((t) => t.meta && t.meta.series === series && t.meta.part === "y");
            const y = trace.y[trace.x.indexOf(step)];
            return [box.left + fl._size.l + fl.xaxis.l2p(step), box.top + fl._size.t + fl.yaxis.l2p(y)];
        }""",
        [figure, series, step],
    )


def test_runs_page_run_charts_and_a_click_to_a_step(tab: Tab, served: Served) -> None:
    page = tab.page
    page.goto("/")
    assert page.locator("#runs-table tbody tr").count() == len(served.runs)
    _shot(page, "runs")
    page.get_by_role("link", name="patched k=4").click()
    page.wait_for_selector("body[data-charts-ready]")
    for figure in ("reward", "buckets", "control"):  # the factory records no votes
        assert page.locator(f"#fig-{figure} svg.main-svg").count() >= 1, figure
        assert _traces(page, figure) >= 2, figure
    assert page.locator("#run-card").get_by_text("8 × 1 prompt").is_visible()
    _shot(page, "run")
    x, y = _point(page, "reward", "reward_mean", 30)
    page.mouse.move(x, y)
    page.mouse.click(x, y)
    page.wait_for_url(re.compile(rf"/runs/{served.runs['patched']}/steps/30$"))
    assert page.locator("#step-number").inner_text() == "30"


def test_step_viewer_keyboard(tab: Tab, served: Served) -> None:
    page = tab.page
    run = served.runs["leaky"]
    page.goto(f"/runs/{run}/steps/30")
    for key in ("7", "0", "3"):
        page.keyboard.press(key)
        assert page.locator(f"#tab-{key}").get_attribute("aria-selected") == "true"
        assert page.locator(f"#rollout-{key}").is_visible()
        assert page.locator("[role=tabpanel]:visible").count() == 1
    page.locator("#prompt summary").click()
    _shot(page, "step-viewer")
    page.keyboard.press("ArrowRight")
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/31#r3$"))
    assert (
        page.locator("#tab-3").get_attribute("aria-selected") == "true"
    )  # the same rollout stays open
    page.keyboard.press("ArrowLeft")
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/30#r3$"))
    page.keyboard.press("End")
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/60#r3$"))
    page.locator("#step-input").fill("12")
    page.locator("#step-input").press("Enter")
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/12$"))


def test_compare_two_runs(tab: Tab, served: Served) -> None:
    page = tab.page
    page.goto("/")
    assert page.locator("#compare-button").is_disabled()
    page.get_by_label(f"Select run {served.runs['patched']}").check()
    page.get_by_label(f"Select run {served.runs['leaky']}").check()
    page.locator("#compare-button").click()
    page.wait_for_url(re.compile(r"/compare\?runs=\d+,\d+$"))
    page.wait_for_selector("body[data-charts-ready]")
    legend = page.locator("#charts-compare figure").first.locator(".legendtext").all_text_contents()
    assert any("patched k=4" in t for t in legend) and any("leaky 64 tools" in t for t in legend)
    assert _traces(page, "c-0") == 6  # band + line for each run
    cards = page.locator(".pair-body .step-card")
    assert cards.count() == 2 and cards.first.get_attribute("data-step") == "60"
    _shot(page, "compare")
    page.locator("#cmp-prev").click()
    page.wait_for_selector("body[data-pair-step='59']")
    assert [cards.nth(i).get_attribute("data-step") for i in range(2)] == ["59", "59"]
    assert page.url.endswith("step=59")


def test_untrusted_completion_does_not_run(tab: Tab, served: Served) -> None:
    page = tab.page
    run = served.runs["xss"]
    page.goto(f"/runs/{run}/steps/2")
    completion = page.locator("#rollout-0 pre.completion")
    assert completion.inner_text() == "<script>alert(1)</script></textarea>{{7*7}}␇"
    assert page.locator("textarea").count() == 0
    page.goto(f"/runs/{run}")
    page.wait_for_selector("body[data-charts-ready]")
    assert page.locator("h1").inner_text().startswith("<img src=x onerror=alert(2)>")
    # Compare swaps server-rendered step cards in with innerHTML: still inert.
    page.goto(f"/compare?runs={run},{served.runs['patched']}")
    page.wait_for_selector("body[data-charts-ready]")
    page.locator("#cmp-prev").click()
    page.wait_for_selector("body[data-pair-step='2']")
    assert "<script>alert(1)</script>" in page.locator(".pair-body").first.inner_text()
    page.wait_for_timeout(300)
    assert tab.dialogs == []


def test_pages_follow_a_training_run(tab: Tab, served: Served) -> None:
    page = tab.page
    run = served.runs["live"]
    runs_page = page.context.new_page()
    runs_page.goto("/")
    row = runs_page.locator(f"tr[data-run-id='{run}']")
    assert row.locator("[data-field=current_step]").inner_text() == "8"
    page.goto(f"/runs/{run}")
    page.wait_for_selector("body[data-charts-ready]")
    assert page.locator("#live").is_visible()
    rng = random.Random(0)
    for step in (9, 10, 11, 12):
        rollouts = make_rollouts(rng)
        acc = sum(r.true_score or 0 for r in rollouts) / 8
        values = {"reward_mean": acc, "true_accuracy": acc}
        record_step(served.factory, run, step, values=values, rollouts=rollouts)
    page.wait_for_function(
        "() => document.querySelector('#run-card [data-field=current_step]').textContent === '12'"
    )
    length = "document.getElementById('fig-reward').data.find(t => t.meta.part === 'y').x.length"
    page.wait_for_function(f"() => {length} === 12")
    runs_page.wait_for_function(
        f"() => document.querySelector(\"tr[data-run-id='{run}'] [data-field=current_step]\").textContent === '12'"
    )
    with session_scope(served.factory) as session:
        store.mark_finished(session, run_id=run, status=RunStatus.completed)
    page.wait_for_function(
        "() => document.querySelector('#run-card [data-field=status] .badge').textContent === 'completed'"
    )
    assert page.locator("#live").is_hidden()
    runs_page.close()


def test_api_docs_work_offline(tab: Tab) -> None:
    page = tab.page
    page.goto("/docs")
    page.wait_for_selector(".swagger-ui .opblock")
    assert page.get_by_text("/api/runs/{run_id}/series").count() >= 1


def _annotations(page: Page, figure: str) -> list[str]:
    """The alert markers Plotly drew on a chart (their hover text)."""
    return page.evaluate(
        "(id) => (document.getElementById(`fig-${id}`).layout.annotations || []).map((a) => a.hovertext)",
        figure,
    )


def test_run_page_marks_alerts_and_sft_phases_on_the_charts(tab: Tab, served: Served) -> None:
    page = tab.page
    run = served.runs["collapse"]
    page.goto(f"/runs/{run}")
    page.wait_for_selector("body[data-charts-ready]")
    assert page.locator("#alert-list li").count() == 2
    assert page.locator("#warning-count").inner_text() == "2 warnings"  # as run.js counts them
    probes = _annotations(page, "probes")
    assert len(probes) == 2 and probes[0].startswith("control token spike: probe/eot_after_open")
    assert _annotations(page, "states") == [probes[1]] and probes[1].startswith("collapse:")
    assert _annotations(page, "reward") == []  # neither alert is about reward hacking
    # ⚠ markers drawn on the page, and dotted lines at their steps.
    assert page.locator("#fig-probes .annotation-text").count() == 2
    shapes = page.evaluate("document.getElementById('fig-states').layout.shapes")
    lines = [sh["x0"] for sh in shapes if sh["type"] == "line"]
    bands = [(sh["x0"], sh["x1"]) for sh in shapes if sh["type"] == "rect"]
    assert lines == [COLLAPSE_STEP]
    assert bands == [(25, 26), (50, 51), (75, 76), (100, 101)]  # SFT after steps 25, 50, …
    for figure in ("states", "probes", "probe-eot_after_open", "eval", "sft"):
        assert page.locator(f"#fig-{figure} svg.main-svg").count() >= 1, figure
        assert (
            page.evaluate(
                f"document.getElementById('fig-{figure}').closest('figure').classList.contains('no-data')"
            )
            is False
        )
    _shot(page, "run-collapse")
    page.locator("#charts-structure").scroll_into_view_if_needed()
    page.locator("#fig-probes .annotation-text").first.click()
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/{PROBE_SPIKE_STEP}$"))


def test_runs_list_shows_an_alert_badge_that_links_to_steps(tab: Tab, served: Served) -> None:
    page = tab.page
    run = served.runs["collapse"]
    page.goto("/")
    badge = page.locator(f"tr[data-run-id='{run}'] .alert-badge")
    badge.locator("summary").wait_for()
    assert badge.locator("summary").inner_text() == "⚠ 2"
    assert page.locator(f"tr[data-run-id='{served.runs['patched']}'] .alert-badge").count() == 0
    badge.locator("summary").click()
    _shot(page, "runs-alerts")
    assert badge.locator("a.alert-rollouts").count() == 2  # each alert's rollouts, in the explorer
    badge.locator("a:not(.alert-rollouts)").nth(1).click()
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/{COLLAPSE_STEP}$"))


def test_step_viewer_shows_supervised_rollouts_and_hints(tab: Tab, served: Served) -> None:
    page = tab.page
    page.goto(f"/runs/{served.runs['supervised']}/steps/2")
    assert page.locator("#tab-6 .tab-origin").inner_text() == "expert"
    page.keyboard.press("7")
    assert page.locator("#rollout-7 .hint-text").inner_text() == HINT.removeprefix("Hint: ")
    _shot(page, "step-viewer-hint")


def test_launch_form_keeps_values_and_shows_errors_in_place(tab: Tab, served: Served) -> None:
    page = tab.page
    page.goto("/")
    page.get_by_role("link", name="New run").click()
    page.wait_for_url(re.compile(r"/runs/new$"))
    _shot(page, "launch-form")
    page.get_by_role("link", name=re.compile("Hinted rollouts")).click()
    page.wait_for_url(re.compile(r"preset=hint"))
    page.wait_for_load_state("load")  # launch.js has dimmed the fields that do not apply
    assert page.locator("#f-supervision").input_value() == "hint"
    playwright.expect(page.locator("#f-supervised_per_group").locator("..")).not_to_have_class(
        re.compile(r"\birrelevant\b")
    )
    playwright.expect(page.locator("#f-sft_every").locator("..")).to_have_class(
        re.compile(r"\birrelevant\b")
    )
    page.locator("#f-k").fill("99")
    page.locator("#f-supervised_per_group").fill("8")
    page.locator("#f-seed").fill("12")
    page.locator("#launch-button").click()
    page.wait_for_selector("#form-errors")
    assert "Shortlist size k must be at most 64" in page.locator("#err-k").inner_text()
    assert "smaller than Group size G" in page.locator("#err-supervised_per_group").inner_text()
    assert (
        page.locator("#f-k").input_value() == "99" and page.locator("#f-seed").input_value() == "12"
    )
    assert page.locator("#f-supervision").input_value() == "hint"
    _shot(page, "launch-form-errors")
    with session_scope(served.factory) as session:
        assert len(store.list_runs(session)) == len(served.runs)  # nothing was created
    # The form came back as a 422, which Chromium logs; that one is meant.
    tab.errors[:] = [e for e in tab.errors if "status of 422" not in e]


def test_launch_form_switches_the_budget_with_the_turns(tab: Tab, served: Served) -> None:
    """Choosing multi-turn swaps the single reply's 8 tokens for 128 and brings the multi-turn
    fields forward; a budget the user typed stays; a multi-turn preset fills the form."""
    page = tab.page
    page.goto("/runs/new")
    page.wait_for_load_state("load")
    tokens, episodes = page.locator("#f-max_completion_tokens"), page.locator("#f-episodes")
    assert tokens.input_value() == "8"
    playwright.expect(episodes.locator("..")).to_have_class(re.compile(r"\birrelevant\b"))
    page.locator("#f-turns").select_option("multi")
    assert tokens.input_value() == "128"
    playwright.expect(episodes.locator("..")).not_to_have_class(re.compile(r"\birrelevant\b"))
    page.locator("#f-turns").select_option("single")
    assert tokens.input_value() == "8"
    tokens.fill("64")
    page.locator("#f-turns").select_option("multi")
    assert tokens.input_value() == "64"  # typed by the user: kept
    page.goto("/runs/new?preset=multi_leaky_vs_patched")
    page.wait_for_load_state("load")
    assert page.locator("#f-turns").input_value() == "multi"
    assert tokens.input_value() == "128"
    assert page.locator("#f-verifier").input_value() == "judge"
    _shot(page, "launch-form-multi-turn")


def test_launch_form_takes_a_pretrained_models_defaults(tab: Tab, served: Served) -> None:
    """Naming a model other than the tiny one swaps the budget and the learning rates still at
    the tiny model's defaults for a pretrained model's (and their "default" texts); back to
    `tiny` swaps them back; a learning rate the user typed stays."""
    page = tab.page
    page.goto("/runs/new")
    page.wait_for_load_state("load")
    model, tokens = page.locator("#f-model"), page.locator("#f-max_completion_tokens")
    rate, sft_rate = page.locator("#f-learning_rate"), page.locator("#f-sft_learning_rate")
    assert (tokens.input_value(), rate.input_value()) == ("8", "0.0003")
    model.fill("/models/smollm2-135m-instruct")
    assert (tokens.input_value(), rate.input_value(), sft_rate.input_value()) == (
        "32",
        "1e-05",
        "1e-05",
    )
    help_text = page.locator("#help-learning_rate .field-default")
    playwright.expect(help_text).to_have_text("default 1e-05")
    page.locator("#f-turns").select_option("multi")
    assert tokens.input_value() == "256"
    _shot(page, "launch-form-pretrained")
    rate.fill("2e-6")
    model.fill("tiny")
    assert (tokens.input_value(), rate.input_value()) == ("128", "2e-6")
    playwright.expect(help_text).to_have_text("default 0.0003")


def test_runs_page_pages_and_follows_the_runs_it_shows(tab: Tab, served: Served) -> None:
    """Pages of two runs: Next and Previous keep the page size, a training run on page 2 is
    followed live, a new run is announced, and Enter searches every run."""
    page = tab.page
    training = make_run(
        served.factory, steps=2, seed=20, name="paged training", status=RunStatus.running
    )
    newer = [make_run(served.factory, steps=1, seed=21 + i, name=f"paged {i}") for i in range(2)]
    served.runs |= {"paged training": training, "paged 0": newer[0], "paged 1": newer[1]}
    ids = sorted(served.runs.values(), reverse=True)
    page.goto("/?per_page=2")
    shown = "#runs-table tbody tr"
    assert page.locator(shown).count() == 2
    assert page.locator("#showing").inner_text() == f"Showing 1–2 of {len(ids)}"
    page.get_by_role("link", name="Next →").click()
    page.wait_for_url(re.compile(r"page=2&per_page=2$"))
    assert [
        int(r) for r in page.locator(shown).evaluate_all("rows => rows.map((r) => r.dataset.runId)")
    ] == ids[2:4]
    assert page.locator("#showing").inner_text() == f"Showing 3–4 of {len(ids)}"
    _shot(page, "runs-page-2")
    # The training run on this page is followed; a run newer than every page is announced.
    record_step(served.factory, training, 3, values={"true_accuracy": 1.0})
    step = f"tr[data-run-id='{training}'] [data-field=current_step]"
    page.wait_for_function(f"() => document.querySelector(\"{step}\").textContent === '3'")
    served.runs["paged fresh"] = make_run(served.factory, steps=1, seed=30, name="paged fresh")
    page.locator("#new-runs").wait_for()
    assert page.locator("#new-runs-text").inner_text() == "1 new run."
    page.get_by_role("link", name="← Previous").click()
    page.wait_for_url(re.compile(r"page=1&per_page=2$"))
    # Typing filters this page; Enter searches every run (keeping the page size).
    page.locator("#run-filter").fill("leaky")
    assert page.locator(f"{shown}:visible").count() == 0
    assert page.locator("#filter-empty").is_visible()
    page.locator("#run-filter").press("Enter")
    page.wait_for_url(re.compile(r"q=leaky"))
    assert page.locator(shown).count() == 1 and "per_page=2" in page.url
    assert page.locator("#showing").inner_text() == "Showing 1–1 of 1"
    with session_scope(served.factory) as session:
        store.mark_finished(session, run_id=training, status=RunStatus.completed)


def test_groups_overview_group_page_and_keys_between_groups(tab: Tab, served: Served) -> None:
    page = tab.page
    run = served.runs["groups"]
    page.goto(f"/runs/{run}/steps/1")
    rows = page.locator("#groups-table tbody tr")
    assert rows.count() == GROUPS
    _shot(page, "step-groups")
    # the groups that need a look: verifier ≠ truth
    page.locator("#looks a[data-look=disagree]").click()
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/1\?look=disagree$"))
    flagged = [int(g) for g in rows.evaluate_all("rs => rs.map(r => r.dataset.group)")]
    assert flagged and all(
        "flag-disagree" in (rows.nth(i).get_attribute("class") or "") for i in range(len(flagged))
    )
    # sorted by the largest |advantage|, biggest first
    page.locator("th[data-sort=max_abs_advantage] a").click()
    page.wait_for_url(re.compile(r"sort=max_abs_advantage&order=desc"))
    values = [
        float(t) for t in page.locator("#groups-table tbody tr td:last-child").all_inner_texts()
    ]
    assert values == sorted(values, reverse=True)
    order = [int(g) for g in rows.evaluate_all("rs => rs.map(r => r.dataset.group)")]
    # j moves down the rows, Enter opens the group
    page.keyboard.press("j")
    page.keyboard.press("j")
    assert "current" in (rows.nth(1).get_attribute("class") or "")
    page.keyboard.press("Enter")
    group = order[1]
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/1/groups/{group}$"))
    assert page.locator("#group-number").inner_text() == str(group)
    table = page.locator("#group-table tbody tr")
    assert table.count() == 8
    marked = table.evaluate_all(
        "rs => rs.filter(r => r.dataset.disagree).map(r => r.dataset.index)"
    )
    tabs = page.locator("#rollout-tabs [role=tab][data-disagree]")
    assert marked and tabs.count() == len(marked)
    # a table row's number opens its rollout
    table.nth(int(marked[0])).locator("button[data-tab]").click()
    assert page.locator(f"#tab-{marked[0]}").get_attribute("aria-selected") == "true"
    assert page.locator(f"#rollout-{marked[0]}").is_visible()
    _shot(page, "group-page")
    # ] and [ move between groups keeping the rollout open; ← → move between steps keeping both
    page.keyboard.press("3")
    there, back = ("]", "[") if group + 1 < GROUPS else ("[", "]")
    other = group + 1 if there == "]" else group - 1
    page.keyboard.press(there)
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/1/groups/{other}#r3$"))
    assert page.locator("#tab-3").get_attribute("aria-selected") == "true"
    page.keyboard.press(back)
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/1/groups/{group}#r3$"))
    page.keyboard.press("ArrowRight")
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/2/groups/{group}#r3$"))
    assert page.locator("#tab-3").get_attribute("aria-selected") == "true"
    page.locator("#overview-link").click()
    page.wait_for_url(re.compile(rf"/runs/{run}/steps/2$"))
    assert page.locator("#groups-table tbody tr").count() == GROUPS


def test_the_rollout_explorer_filters_sorts_pages_and_opens_a_rollout(
    tab: Tab, served: Served
) -> None:
    page = tab.page
    run_id = served.runs["groups"]
    page.goto(f"/runs/{run_id}")
    page.locator("#explorer-link").click()
    page.wait_for_url(f"**/runs/{run_id}/rollouts")
    total = int(page.locator("#rollout-count").inner_text().replace(",", ""))
    assert total == 2 * GROUPS * 8
    # filter: verifier ≠ truth at step 2, sorted by |advantage| going down
    form = page.locator("#explorer-filters")
    form.locator("input[name=steps]").fill("2")
    form.locator("input[name=disagree]").check()
    form.get_by_role("button", name="Filter").click()
    page.wait_for_url("**disagree=true**")
    rows = page.locator("#rollouts-table tbody tr")
    assert rows.count() > 0
    for i in range(rows.count()):
        assert "disagree" in (rows.nth(i).get_attribute("class") or "")
        assert rows.nth(i).locator("td").first.inner_text() == "2"
    page.get_by_role("link", name="|Adv.|").click()
    page.get_by_role("link", name="|Adv.|").click()  # again: going down
    page.wait_for_url("**order=desc**")
    values = [
        abs(float(v))
        for v in page.locator("#rollouts-table tbody tr td:nth-child(9)").all_inner_texts()
    ]
    assert values == sorted(values, reverse=True) and "disagree=true" in page.url
    _shot(page, "explorer")
    # a row opens its rollout on its group's page, the tab of that rollout selected
    first = rows.first
    group, index = first.locator("td").nth(1).inner_text(), first.locator("td").nth(2).inner_text()
    first.locator("td.completion-head a").click()
    page.wait_for_url(f"**/runs/{run_id}/steps/2/groups/{group}#r{index.lstrip('#')}")
    assert page.locator(f"#tab-{index.lstrip('#')}[aria-selected=true]").count() == 1
    _shot(page, "explorer-rollout")
