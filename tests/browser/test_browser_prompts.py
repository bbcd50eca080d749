"""The prompt lens in Chromium (issue 46): the heatmap renders, a click on a cell opens that
cell's group in the step viewer, the filters narrow the table and the heatmap together, and the
compare page matches a leaky and a patched run of the product's own task by query. Screenshots
of the three pages at the seed's shape (9 prompts × 150 steps) go to the test artifacts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.webapp.app import create_app

from tests import web_support
from tests.browser.test_browser import ARTIFACTS
from tests.prompt_lens_support import looks, oracle, schedule_run
from tests.prompt_pages_support import escalation_pair

pytestmark = pytest.mark.browser

SEED_STEPS, SEED_QUERIES = 150, 9  # the seed's shape: nine queries, 150 steps


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data_dir = tmp_path_factory.mktemp("prompts")
    url = f"sqlite:///{data_dir / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    schedules = schedule_run(factory)
    pair = escalation_pair(factory, steps=SEED_STEPS, queries=SEED_QUERIES)
    truth = oracle(factory, schedules)
    app = create_app(Settings(database_url=url, data_dir=data_dir, lost_after_seconds=3600))
    with web_support.serve_app(app) as base:
        yield {"base": base, "schedules": schedules, "truth": truth, "pair": pair}
    engine.dispose()


@pytest.fixture
def page(browser: Browser, served: dict[str, Any]) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 900}, base_url=served["base"])
    context.set_default_timeout(15_000)
    errors: list[str] = []
    tab = context.new_page()
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    yield tab
    context.close()
    assert errors == []


def _shot(page: Page, name: str, *, full: bool = True) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=full)
    return path


def _table_ids(page: Page) -> list[int]:
    return [
        int(v)
        for v in page.locator("#prompts-table tbody tr").evaluate_all(
            "(rows) => rows.map((r) => r.dataset.promptId)"
        )
    ]


def _heatmap_ids(page: Page) -> list[int]:
    """The prompt ids of the heatmap's rows as drawn, top first."""
    labels = page.evaluate("() => document.getElementById('fig-prompt-heatmap').data[0].y")
    return [int(label.split()[0].lstrip("#")) for label in labels]


def _cell_point(page: Page, row: int, col: int) -> dict[str, float]:
    """Where on the page the heatmap draws cell (row, col): from Plotly's own axes."""
    return page.evaluate(
        """([row, col]) => {
            const el = document.getElementById('fig-prompt-heatmap');
            const trace = el.data[0], fl = el._fullLayout;
            const box = el.querySelector('.nsewdrag').getBoundingClientRect();
            const x = fl.xaxis.d2p(trace.x[col]), y = fl.yaxis.d2p(trace.y[row]);
            return {x: box.left + x + window.scrollX, y: box.top + y + window.scrollY};
        }""",
        [row, col],
    )


def test_the_heatmap_renders_and_a_cell_opens_its_group(page: Page, served: dict[str, Any]) -> None:
    run_id, truth = served["schedules"], served["truth"]
    page.goto(f"/runs/{run_id}/prompts")
    page.wait_for_selector("body[data-charts-ready]")
    # drawn: a heatmap layer in the plot, its rows the table's, a column a step
    assert page.locator("#fig-prompt-heatmap .heatmaplayer .hm").count() == 1
    assert (
        _heatmap_ids(page)
        == _table_ids(page)
        == sorted(truth, key=lambda p: (truth[p]["first_step"], p))
    )
    # the cell of the alternating prompt at step 3 (its two groups there): the first group opens
    prompt_id = max(truth, key=lambda p: truth[p]["flips"])
    row = _heatmap_ids(page).index(prompt_id)
    steps = page.evaluate("() => document.getElementById('fig-prompt-heatmap').data[0].x")
    col = steps.index(3)
    groups = [g for g in truth[prompt_id]["history"] if g["step"] == 3]
    assert len(groups) == 2
    point = _cell_point(page, row, col)
    page.mouse.move(point["x"], point["y"])
    hover = page.locator(".hoverlayer .hovertext")
    hover.wait_for()
    text = hover.text_content() or ""
    assert "step 3 · 2 group(s)" in text and f"#{prompt_id}" in text
    true = sum(t for g in groups for t in g["_trues"]) / sum(len(g["_trues"]) for g in groups)
    assert f"true score {true:.3g}" in text
    _shot(page, "prompts-heatmap-hover")
    page.mouse.click(point["x"], point["y"])
    first = min(g["group"] for g in groups)
    page.wait_for_url(f"**/runs/{run_id}/steps/3/groups/{first}")
    # and back: one click from the group to the prompt's history
    page.locator("#prompt-history-link").click()
    page.wait_for_url(f"**/runs/{run_id}/prompts/{prompt_id}")
    page.wait_for_selector("body[data-charts-ready]")
    assert page.locator("#fig-prompt-history .scatterlayer .trace").count() == 2


def test_the_filters_narrow_the_table_and_the_heatmap(page: Page, served: dict[str, Any]) -> None:
    run_id, truth = served["schedules"], served["truth"]
    page.goto(f"/runs/{run_id}/prompts")
    page.wait_for_selector("body[data-charts-ready]")
    for look in ("never_solved", "flipping", "forgotten", "stuck", "solved"):
        page.locator("#look").select_option(look)
        page.locator("#prompt-filters button[type=submit]").click()
        page.wait_for_url(f"**/runs/{run_id}/prompts?look={look}")
        want = {p for p, figures in truth.items() if look in looks(figures)}
        if not want:
            assert page.locator("#no-prompts").is_visible()
            continue
        page.wait_for_selector("body[data-charts-ready]")
        assert set(_table_ids(page)) == want
        assert _heatmap_ids(page) == _table_ids(page)
        assert page.locator("#prompt-count").inner_text() == str(len(want))
        export = page.locator("#export-prompts").get_attribute("href") or ""
        assert export.endswith(f"/prompts/export.jsonl?look={look}")
    # the search keeps the look; a sort by a header keeps both
    page.locator("#prompt-filters input[name=q]").fill("learned")
    page.locator("#prompt-filters button[type=submit]").click()
    page.wait_for_url("**q=learned**")
    (only,) = _table_ids(page)
    assert "learned" in page.locator("#prompts-table .prompt-label").inner_text()
    assert only in {p for p, f in truth.items() if "solved" in looks(f)}
    page.locator('#prompts-table th[data-sort="flips"] a').click()
    page.wait_for_url("**sort=flips**")
    assert "look=solved" in page.url and "q=learned" in page.url
    # the whole prompt on demand
    details = page.locator("#prompts-table details.prompt-text").first
    assert not details.locator("pre").is_visible()
    details.locator("summary").click()
    assert "You pick tools." in details.locator("pre").inner_text()


def test_compare_matches_the_leaky_and_the_patched_run_by_query(
    page: Page, served: dict[str, Any]
) -> None:
    pair = served["pair"]
    leaky, patched = pair["leaky"], pair["patched"]
    page.goto(f"/compare/prompts?runs={leaky},{patched}")
    page.wait_for_selector("body[data-charts-ready]")
    labels = page.locator("#matches-table tbody .prompt-label").all_inner_texts()
    assert sorted(labels) == sorted(pair["queries"])  # each query once, in both runs
    assert page.locator("#matches-table tbody td.muted").count() == 0  # none only in one run
    assert page.locator(".pair-side .js-plotly-plot").count() == 2
    _shot(page, "compare-prompts-seed")
    # the exact text tells 64 tools from 4 apart: nothing matches; back to the query
    page.locator("#match").select_option("exact")
    page.locator("#match-form button[type=submit]").click()
    page.wait_for_url("**match=exact**")
    assert page.locator("#no-matches").is_visible()
    # another match shown: its histories side by side, each opening its run's group
    page.goto(f"/compare/prompts?runs={leaky},{patched}")
    page.wait_for_selector("body[data-charts-ready]")
    page.locator("#matches-table tbody tr").nth(2).locator("a.prompt-label").click()
    page.wait_for_selector("body[data-charts-ready]")
    assert page.locator("#matches-table tbody tr").nth(2).get_attribute("aria-current") == "true"
    shown = page.locator("#histories .prompt-label").text_content()
    assert shown == labels[2]
    side = page.locator(f'.pair-side[data-run="{patched}"]')
    side.locator("tbody tr a").first.click()
    page.wait_for_url(f"**/runs/{patched}/steps/1/groups/*")


def test_the_seed_shape_screenshots(page: Page, served: dict[str, Any]) -> None:
    """The three pages at 9 prompts × 150 steps, for a person to look at."""
    leaky = served["pair"]["leaky"]
    page.goto(f"/runs/{leaky}/prompts")
    page.wait_for_selector("body[data-charts-ready]")
    assert len(_heatmap_ids(page)) == SEED_QUERIES
    steps = page.evaluate("() => document.getElementById('fig-prompt-heatmap').data[0].x")
    assert steps == list(range(1, SEED_STEPS + 1))  # 150 columns: a step each, no buckets
    _shot(page, "prompts-seed")
    page.locator("#prompts-table a.prompt-label").first.click()
    page.wait_for_selector("body[data-charts-ready]")
    assert page.locator("#history-table tr.history-group").count() == SEED_STEPS
    assert page.locator("#history-table .vote-bar.split").count() > 0  # the leaky run's splits
    # a split vote drawn in proportion: each segment's width its share of the group
    split = page.locator("#history-table .vote-bar.split").first.locator(".vote-seg")
    counts = [
        int((t or "").split(" × ")[0]) for t in split.evaluate_all("(s) => s.map((e) => e.title)")
    ]
    widths = split.evaluate_all("(s) => s.map((e) => e.getBoundingClientRect().width)")
    shares = [w / sum(widths) for w in widths]
    assert shares == pytest.approx([c / sum(counts) for c in counts], abs=0.02)
    _shot(page, "prompt-history-seed", full=False)  # 150 groups: the top is what to look at
    # a group's completions open under it, in place
    fifth = page.locator("#history-table tr.history-group").nth(4)
    below = page.locator("#history-table tr.completions-row").nth(4)
    assert not below.is_visible()
    fifth.locator("a.completions-toggle").click()
    assert below.is_visible() and below.locator("tbody tr").count() == 8
    assert fifth.locator("a.completions-toggle").get_attribute("aria-expanded") == "true"
    below.evaluate("(row) => row.scrollIntoView({block: 'center'})")
    _shot(page, "prompt-history-completions", full=False)
    fifth.locator("a.completions-toggle").click()
    assert not below.is_visible()
