"""The run and compare pages' chart view in Chromium: one smoothing and log-scale setting for
every chart, kept in the URL; charts whose series never changed folded to one line; buckets
drawn over the steps they hold, on the step axis the other charts share."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunStatus
from rollout_lens.server.webapp.app import create_app

from tests import web_support
from tests.browser.test_browser import ARTIFACTS
from tests.factories import CONTROL_TOKENS, record_step

pytestmark = pytest.mark.browser

STEPS = 30
LEARNING_RATE = 3e-4


def _accuracy(step: int, seed: int) -> float:
    """A noisy per-step accuracy (what 8 rollouts give: it swings), higher after step 25."""
    return [0.0, 0.25, 0.125, 0.5, 0.375][(step * (seed + 3)) % 5] + (0.5 if step > 25 else 0)


def _record_run(factory: Any, seed: int) -> int:
    config = {"kl_coef": 0.0, "num_iterations": 1, "variant": "patched", "k": 4, "steps": STEPS}
    with session_scope(factory) as session:
        run_id = store.create_run(
            session,
            name=f"charts run {seed}",
            model="tiny",
            total_steps=STEPS,
            group_size=8,
            seed=seed,
            variant="patched",
            k=4,
            config=config,
            control_tokens=CONTROL_TOKENS,
        ).id
    for step in range(1, STEPS + 1):
        acc = _accuracy(step, seed)
        values = {
            "reward_mean": 0.5 + acc / 2,
            "true_accuracy": acc,
            "format_valid_rate": 1.0,
            "loss": 0.0,
            "learning_rate": LEARNING_RATE,
            "grad_norm": 0.5 + acc,
        }
        evaluated = {f"eval/{n}": acc for n in ("id", "format_ood", "content_ood")}
        record_step(
            factory, run_id, step, values=values, metrics=evaluated if step % 10 == 0 else {}
        )
    with session_scope(factory) as session:
        store.mark_finished(session, run_id=run_id, status=RunStatus.completed)
    return run_id


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[int]]]:
    data_dir = tmp_path_factory.mktemp("charts")
    url = f"sqlite:///{data_dir / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    runs = [_record_run(factory, 0), _record_run(factory, 1)]
    app = create_app(Settings(database_url=url, data_dir=data_dir, lost_after_seconds=3600))
    with web_support.serve_app(app) as base:
        yield base, runs
    engine.dispose()


@pytest.fixture
def page(browser: Browser, served: tuple[str, list[int]]) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 900}, base_url=served[0])
    context.set_default_timeout(10_000)
    errors: list[str] = []
    tab = context.new_page()
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    yield tab
    context.close()
    assert errors == []


def _shot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def _ema(values: list[float], weight: float) -> list[float]:
    """W&B's debiased exponential moving average."""
    out, last = [], 0.0
    for n, v in enumerate(values, start=1):
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight**n))
    return out


def _shown(page: Page, figure: str, series: str, part: str = "y") -> list[float]:
    return page.evaluate(
        """([figure, series, part]) => document.getElementById(`fig-${figure}`).data
            .find((t) => t.meta && t.meta.series === series && t.meta.part === part).y""",
        [figure, series, part],
    )


def _axis_types(page: Page) -> set[str]:
    return set(
        page.evaluate(
            """() => [...document.querySelectorAll("figure:not(.no-data) .plot")]
                .filter((el) => el._fullLayout).map((el) => el._fullLayout.yaxis.type)"""
        )
    )


def test_smoothing_and_log_scale_apply_to_every_chart_and_stay_in_the_url(
    page: Page, served: tuple[str, list[int]]
) -> None:
    run_id = served[1][0]
    accuracy = [_accuracy(s, 0) for s in range(1, STEPS + 1)]
    page.goto(f"/runs/{run_id}?smooth=0")  # raw, asked for (past 20 steps a page opens smoothed)
    page.wait_for_selector("body[data-charts-ready]")
    assert _shown(page, "reward", "true_accuracy") == accuracy

    page.locator("#smoothing").fill("0.6")
    page.wait_for_function("() => document.body.dataset.view === '0.6:0'")
    assert "smooth=0.6" in page.url
    smoothed = _shown(page, "reward", "true_accuracy")
    assert smoothed == pytest.approx(_ema(accuracy, 0.6))
    # The band spans the raw values and the smoothed line; the optimization charts follow too.
    assert _shown(page, "reward", "true_accuracy", "hi") == pytest.approx(
        [max(a, s) for a, s in zip(accuracy, smoothed, strict=True)]
    )
    grad = [0.5 + a for a in accuracy]
    assert _shown(page, "s-grad_norm", "grad_norm") == pytest.approx(_ema(grad, 0.6))

    page.locator("#log-scale").check()
    page.wait_for_function("() => document.body.dataset.view === '0.6:1'")
    assert "log=1" in page.url and _axis_types(page) == {"log"}
    _shot(page, "charts-smoothed-log")

    # A reload (or a shared link) opens with the same view.
    page.reload()
    page.wait_for_selector("body[data-charts-ready]")
    assert page.locator("#smoothing").input_value() == "0.6"
    assert page.locator("#log-scale").is_checked()
    assert _shown(page, "reward", "true_accuracy") == pytest.approx(smoothed)
    assert _axis_types(page) == {"log"}

    # Compare reads the same parameters.
    page.goto(f"/compare?runs={served[1][0]},{served[1][1]}&smooth=0.6")
    page.wait_for_selector("body[data-charts-ready]")
    assert page.locator("#smoothing").input_value() == "0.6"
    shown = page.evaluate(
        """(run) => [...document.querySelectorAll(".plot")].map((el) => el.data || [])
            .flat().find((t) => t.meta && t.meta.series === "true_accuracy"
                && t.meta.part === "y" && t.meta.run === run).y""",
        run_id,
    )
    assert shown == pytest.approx(_ema(accuracy, 0.6))
    _shot(page, "charts-compare-smoothed")


def test_series_that_never_changed_fold_to_one_line(
    page: Page, served: tuple[str, list[int]]
) -> None:
    page.goto(f"/runs/{served[1][0]}")
    page.wait_for_selector("body[data-charts-ready]")
    lr = page.locator('figure[data-figure="s-learning_rate"]')
    assert "flat" in (lr.get_attribute("class") or "")
    assert lr.locator(".flat-text").inner_text() == "0.0003: constant over steps 1–30"
    assert not lr.locator(".plot").is_visible()
    loss = page.locator('figure[data-figure="s-loss"]')
    assert loss.locator(".flat-text").inner_text() == "0: constant over steps 1–30"
    assert "0 by construction at β = 0" in loss.inner_text()  # why it is 0, folded or not
    # A chart with a line that changed stays drawn, whatever its other lines do.
    assert "flat" not in (page.locator('figure[data-figure="reward"]').get_attribute("class") or "")
    assert "folded" in page.locator("#flat-count").inner_text()
    kl = page.locator('figure[data-figure="s-kl"]')
    assert kl.get_attribute("data-empty") == "not computed (β = 0)"
    assert "no-data" in (kl.get_attribute("class") or "")
    _shot(page, "charts-folded")

    lr.locator(".flat-toggle").click()
    assert lr.locator(".plot").is_visible() and lr.locator(".flat-toggle").inner_text() == "fold"
    # Unfolded, the constant line sits halfway up a 0…2×value axis, not at 0 on −0.5…0.5.
    assert _axis_range(page, "s-learning_rate") == pytest.approx([0, 2 * LEARNING_RATE])


def test_buckets_are_drawn_over_their_steps_on_the_shared_axis(
    page: Page, served: tuple[str, list[int]]
) -> None:
    page.goto(f"/runs/{served[1][0]}")
    page.wait_for_selector("body[data-charts-ready]")
    centers = page.evaluate(
        """() => document.getElementById("fig-buckets").data
            .filter((t) => t.meta.bucket === "true_accuracy")
            .map((t) => [t.meta.part, t.x, t.marker ? t.marker.symbol : null, t.customdata || null])"""
    )
    parts = {part: (x, symbol, text) for part, x, symbol, text in centers}
    # Steps 1–25 closed, 26–30 filling: segments over their steps, markers at their centres.
    assert parts["closed"][0] == [1, 25, None] and parts["partial"][0] == [26, 30, None]
    assert parts["center"][0] == [13, 28]
    assert parts["center"][1] == ["circle", "circle-open"]
    assert parts["center"][2] == ["steps 1–25", "steps 26–30 (5 of 25 so far)"]
    ranges = page.evaluate(
        """() => ["buckets", "reward", "s-grad_norm"].map(
            (id) => document.getElementById(`fig-${id}`)._fullLayout.xaxis.range)"""
    )
    assert ranges[0] == ranges[1] == ranges[2] == [0.5, 30.5]
    accuracy = [_accuracy(s, 0) for s in range(1, STEPS + 1)]
    means = page.evaluate(
        """() => document.getElementById("fig-buckets").data
            .find((t) => t.meta.bucket === "true_accuracy" && t.meta.part === "center").y"""
    )
    assert means == pytest.approx([sum(accuracy[:25]) / 25, sum(accuracy[25:]) / 5])
    assert math.isclose(max(_axis_range(page, "buckets")), 1.0, abs_tol=0.1)


def _axis_range(page: Page, figure: str) -> list[float]:
    return page.evaluate(f"() => document.getElementById('fig-{figure}')._fullLayout.yaxis.range")


def test_compares_summary_fits_a_1400_pixel_window(
    page: Page, served: tuple[str, list[int]]
) -> None:
    page.goto(f"/compare?runs={served[1][0]},{served[1][1]}")
    page.wait_for_selector("body[data-charts-ready]")
    box = page.locator("table.summary").locator("xpath=..")
    widths = box.evaluate("(el) => [el.scrollWidth, el.clientWidth]")
    assert widths[0] <= widths[1], f"the summary scrolls sideways: {widths}"
    headers = page.locator("table.summary th").all_text_contents()
    assert [h.replace("\n", " ") for h in headers[-5:-2]] == [
        "Eval: training queries",
        "Eval: other reply format",
        "Eval: paraphrased queries",
    ]
    _shot(page, "compare-summary")


def test_a_zoom_is_shared_and_a_reset_returns_every_chart_to_the_runs_steps(
    page: Page, served: tuple[str, list[int]]
) -> None:
    page.goto(f"/runs/{served[1][0]}")
    page.wait_for_selector("body[data-charts-ready]")
    ranges = """() => ["reward", "buckets", "s-grad_norm"].map(
        (id) => document.getElementById(`fig-${id}`)._fullLayout.xaxis.range.map(Math.round))"""
    page.evaluate(
        "() => Plotly.relayout(document.getElementById('fig-reward'), {'xaxis.range': [5, 12]})"
    )
    page.wait_for_function(f"() => ({ranges})().every((r) => r[0] === 5 && r[1] === 12)")
    # What a double-click does: autorange, which goes back to steps 1–30 on every chart (not
    # to each chart's own extent).
    page.evaluate(
        "() => Plotly.relayout(document.getElementById('fig-buckets'), {'xaxis.autorange': true})"
    )
    page.wait_for_function(
        """() => ["reward", "buckets", "s-grad_norm"].every((id) => {
            const r = document.getElementById(`fig-${id}`)._fullLayout.xaxis.range;
            return r[0] === 0.5 && r[1] === 30.5;
        })"""
    )
