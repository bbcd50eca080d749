"""The mismatch drill-down in Chromium (issue 47): the histogram renders with its bands on a log
axis, the scatter draws every point the server sent, a worst token's link and a click on a worst
point each open that rollout in the step viewer, and a hostile token stays text. Screenshots of
the page go to the test artifacts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.webapp.app import create_app

from tests import web_support
from tests.browser.test_browser import ARTIFACTS
from tests.mismatch_support import HOSTILE, mismatch_run

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data_dir = tmp_path_factory.mktemp("mismatch")
    url = f"sqlite:///{data_dir / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    run_id = mismatch_run(factory, steps=5, groups=8, group_size=8, hostile=True, seed=5)
    app = create_app(Settings(database_url=url, data_dir=data_dir, lost_after_seconds=3600))
    with web_support.serve_app(app) as base:
        yield {"base": base, "run": run_id}
    engine.dispose()


@pytest.fixture
def page(browser: Browser, served: dict[str, Any]) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 900}, base_url=served["base"])
    context.set_default_timeout(15_000)
    errors: list[str] = []
    tab = context.new_page()
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    tab.on("dialog", lambda dialog: errors.append(f"dialog: {dialog.message}"))
    yield tab
    context.close()
    assert errors == []


def _selected_tab(page: Page) -> int:
    page.wait_for_selector('[role="tab"][aria-selected="true"]')
    return int(
        page.evaluate(
            """() => [...document.querySelectorAll('[role="tab"]')]
                .findIndex((t) => t.getAttribute('aria-selected') === 'true')"""
        )
    )


def test_the_histogram_renders_and_a_worst_token_opens_its_rollout(
    page: Page, served: dict[str, Any]
) -> None:
    run_id = served["run"]
    page.goto(f"/runs/{run_id}/mismatch?from=1&to=5")
    page.wait_for_selector("body[data-charts-ready]")
    drawn = page.evaluate(
        """() => {
            const h = document.getElementById('fig-mismatch-histogram');
            const s = document.getElementById('fig-mismatch-scatter');
            const counts = h.data[0].y.filter((c) => c !== null).length;
            const points = s.data.filter((t) => t.mode === 'markers')
                .reduce((n, t) => n + t.x.length, 0);
            return {
                bars: [...h.querySelectorAll('.barlayer .point path')]
                    .filter((b) => b.getBoundingClientRect().height > 0).length, counts,
                log: h._fullLayout.yaxis.type, bands: h._fullLayout.shapes.length,
                markers: s.querySelectorAll('.scatterlayer .points path').length, points,
            };
        }"""
    )
    assert drawn["bars"] == drawn["counts"] > 5
    assert drawn["log"] == "log" and drawn["bands"] == 4
    assert drawn["markers"] == drawn["points"] > 0
    cell = page.locator("#worst-tokens td.token-context mark.worst").filter(has_text="script")
    assert cell.count() >= 1 and HOSTILE in (cell.first.text_content() or "")
    page.screenshot(path=str(ARTIFACTS / "mismatch-range.png"), full_page=True)
    first = page.locator("#worst-tokens tr.worst-token").first
    step, group, index = (
        int(first.get_attribute(f"data-{k}") or -1) for k in ("step", "group", "index")
    )
    first.locator("a.rollout-link").click()
    page.wait_for_url(f"**/runs/{run_id}/steps/{step}/groups/{group}#r{index}")
    assert _selected_tab(page) == index


def test_a_click_on_a_worst_point_opens_its_rollout(page: Page, served: dict[str, Any]) -> None:
    run_id = served["run"]
    page.goto(f"/runs/{run_id}/mismatch?step=5")
    page.wait_for_selector("body[data-charts-ready]")
    point = page.evaluate(
        """() => {
            const el = document.getElementById('fig-mismatch-scatter');
            const trace = el.data.find((t) => t.name === 'worst tokens'), fl = el._fullLayout;
            const box = el.querySelector('.nsewdrag').getBoundingClientRect();
            const x = fl.xaxis.l2p(Math.log10(trace.x[0])), y = fl.yaxis.l2p(Math.log10(trace.y[0]));
            return {x: box.left + x, y: box.top + y, owner: trace.customdata[0]};
        }"""
    )
    step, group, index = point["owner"]
    page.mouse.move(point["x"], point["y"])
    hover = page.locator(".hoverlayer .hovertext")
    hover.wait_for()
    assert f"step {step} · group {group} · #{index}" in (hover.text_content() or "")
    page.mouse.click(point["x"], point["y"])
    page.wait_for_url(f"**/runs/{run_id}/steps/{step}/groups/{group}#r{index}")
    assert _selected_tab(page) == index
