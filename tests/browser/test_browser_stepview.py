"""The step viewer's marks in a real browser (Playwright driving Debian's Chromium): a multi-turn
group as the issue's user saw it (a rollout that ran out of calls, the one right rollout that
called tool_00 twice before tool_59, tool results that are a Python dict and a JSON object), the
same group recorded before votes were final answers, where a hint was and was not shown to
the model, and a run with the generator's logprobs whose tokens shade by log r (hostile token
texts among them). Screenshots go to $ROLLOUT_LENS_TEST_ARTIFACTS as stepview-*.png."""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rollout_lens.server import store
from rollout_lens.server.core.config import Settings
from rollout_lens.server.store.db import make_engine, make_session_factory, session_scope
from rollout_lens.server.store.migrate import upgrade
from rollout_lens.server.store.models import RunStatus
from rollout_lens.server.webapp.app import create_app

from tests.factories import (
    CONTROL_TOKENS,
    make_multiturn_group,
    make_prompt,
    make_rollouts,
    record_step,
    with_generator,
)
from tests.web_support import HINT, record_supervised_run, serve_app

pytest.importorskip("playwright.sync_api")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.browser

ARTIFACTS = Path(
    os.environ.get("ROLLOUT_LENS_TEST_ARTIFACTS")
    or Path(__file__).resolve().parents[2] / "test-artifacts"
)
DATASET_HINT = "Hint: the tool that can evaluate an arithmetic expression."
GREEN = "rgb(220, 245, 228)"  # .badge.tone-ok
AMBER = "rgb(253, 240, 213)"  # .badge.tone-warn


@dataclass
class Served:
    url: str
    runs: dict[str, int]


def _multiturn_run(factory: Any, *, legacy: bool) -> int:
    with session_scope(factory) as session:
        run_id = store.create_run(
            session,
            name=f"multi-turn{' (recorded before)' if legacy else ''}",
            model="tiny-multiturn",
            total_steps=1,
            group_size=4,
            config={"turns": "multi", "max_calls": 4},
            control_tokens=CONTROL_TOKENS,
        ).id
    record_step(factory, run_id, 1, values={"reward_mean": 0.25}, rollouts=make_multiturn_group(legacy=legacy))  # fmt: skip
    return run_id


def _hinted_dataset_run(factory: Any) -> int:
    """A single-turn run whose dataset rows have a hint no rollout was shown."""
    with session_scope(factory) as session:
        run_id = store.create_run(
            session, name="dataset hint", model="tiny", total_steps=1, group_size=8,
            control_tokens=CONTROL_TOKENS,
        ).id  # fmt: skip
    rollouts = make_rollouts(random.Random(5))
    for r in rollouts:
        r.meta = r.meta | {"hint": DATASET_HINT}
    record_step(factory, run_id, 1, values={"reward_mean": 0.5}, rollouts=rollouts)
    return run_id


# Token texts a page must show as text: tags, an attribute breaking out, a template expression.
HOSTILE_TOKENS = ("<script>alert(1)</script>", '"><img src=x onerror=alert(2)>', "{{7*7}}")
WORDS = ("the", "weather", "tool", "is", "tool_07", "so", "I", "call", "it", "now", "with", "city")


def _two_sided_run(factory: Any) -> int:
    """A run with the generator's logprobs: a group of eight 40-token replies (words, and the
    hostile texts among them; the generator off by more where the trainer's probability is
    low, as mismatch is) and a multi-turn group, tool results masked."""
    with session_scope(factory) as session:
        run_id = store.create_run(
            session, name="two-sided <b>mismatch</b>", model="tiny", total_steps=1,
            group_size=8, control_tokens=CONTROL_TOKENS, status=RunStatus.completed,
        ).id  # fmt: skip
    rng = random.Random(47)
    words = [f" {w}" for w in WORDS] + [","]
    vocabulary = words + list(HOSTILE_TOKENS)
    rollouts = make_rollouts(rng)
    for r in rollouts:
        tokens = [rng.choice(words) for _ in range(40)]
        tokens[3 + r.index] = HOSTILE_TOKENS[r.index % 3]
        r.prompt = make_prompt(["tool_07", "tool_03"], query="the weather in Paris")
        r.completion = "".join(tokens)
        r.completion_ids = [300 + vocabulary.index(t) for t in tokens]
        r.tokens = tokens
        r.token_logprobs = [math.log(rng.betavariate(3, 1)) for _ in tokens]
        r.control_probs = None
        generator = [
            min(0.0, lp + rng.gauss(0.0, 0.05 + 0.8 * (1 - math.exp(lp)) ** 2))
            for lp in r.token_logprobs
        ]
        generator[20 + r.index] = r.token_logprobs[20 + r.index] - 2.0  # r = e² > 5: stale
        generator[rng.randrange(20)] = math.nan  # vLLM gave none for one token
        r.generator_logprobs = generator
    multi = with_generator(make_multiturn_group(group=1), rng, spread=0.8)
    record_step(factory, run_id, 1, values={"reward_mean": 0.5}, rollouts=rollouts + multi)
    return run_id


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    data_dir = tmp_path_factory.mktemp("stepview")
    url = f"sqlite:///{data_dir / 'rollout-lens.db'}"
    engine = make_engine(url)
    upgrade(engine)
    factory = make_session_factory(engine)
    runs = {
        "multi": _multiturn_run(factory, legacy=False),
        "legacy": _multiturn_run(factory, legacy=True),
        "dataset_hint": _hinted_dataset_run(factory),
        "supervised": record_supervised_run(factory, steps=1),
        "two_sided": _two_sided_run(factory),
    }
    app = create_app(Settings(database_url=url, data_dir=data_dir, lost_after_seconds=3600))
    with serve_app(app) as base:
        yield Served(base, runs)
    engine.dispose()


@pytest.fixture
def page(browser: Any, served: Served) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1440, "height": 900}, base_url=served.url)
    context.set_default_timeout(10_000)
    errors: list[str] = []
    page = context.new_page()
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    yield page
    context.close()
    assert errors == []


def _shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"stepview-{name}.png"), full_page=True)


def _style(locator: Any, prop: str) -> str:
    return str(locator.evaluate(f"e => getComputedStyle(e).{prop}"))


def test_a_multiturn_vote_is_its_answer_with_its_first_call_beside(
    page: Any, served: Served
) -> None:
    page.goto(f"/runs/{served.runs['multi']}/steps/1")
    right = page.locator("#rollout-0 .rollout-stats")
    vote = right.locator(".vote-stat")
    assert vote.locator(".label").inner_text() == "vote: final answer"
    assert vote.locator(".value").inner_text() == "48 (from tool_59)"
    assert right.locator(".first-call").inner_text() == "tool_00"
    # the group's votes count the tool that gave the answer: the target appears, and tool_00
    # (which every rollout but the silent one called first) is counted under first calls
    votes = page.locator(".group-card ul.votes:not(.answers)").first
    assert "the tool whose result gave its final answer" in page.locator("#vote-kind").inner_text()
    target_row = votes.locator("li.vote.target")
    assert target_row.locator(".vote-id").inner_text() == "tool_59"
    first_calls = page.locator("#first-calls li")
    assert first_calls.first.locator(".vote-id").inner_text() == "tool_00"
    assert first_calls.first.locator(".vote-count").inner_text() == "2"
    # the table of all rollouts says the same in each row
    row = page.locator("#group-table tbody tr").nth(0).locator(".vote-cell")
    assert row.inner_text().split("\n") == ["answer 48 (from tool_59)", "first call: tool_00"]
    out_of_calls = page.locator("#group-table tbody tr").nth(1).locator(".vote-cell")
    assert out_of_calls.inner_text().split("\n") == ["no answer", "first call: tool_00"]
    silent = page.locator("#group-table tbody tr").nth(3).locator(".vote-cell")
    assert silent.inner_text().split("\n") == ["answer 77", "first call: none"]
    _shot(page, "multiturn-group")


def test_the_format_badge_is_the_rollouts_state_and_the_key_explains_every_mark(
    page: Any, served: Served
) -> None:
    page.goto(f"/runs/{served.runs['multi']}/steps/1#r1")
    stats = page.locator("#rollout-1 .format-stat")
    state = stats.locator(".state-badge")
    # every call it made was well-formed: its state is a healthy call, drawn green; it is not
    # format-valid because it never answered, which is its own amber mark beside
    assert state.inner_text() == "healthy_call"
    assert _style(state, "backgroundColor") == GREEN
    problem = stats.locator(".format-problem")
    assert problem.inner_text() == "ran out of calls"
    assert _style(problem, "backgroundColor") == AMBER
    assert "4 tool results" in (problem.get_attribute("title") or "")
    # the wavy underline on its tab, and its explanation in the key, folded until asked for
    tab = page.locator("#tab-1")
    assert _style(tab, "textDecorationStyle") == "wavy"
    assert "not format-valid" in (tab.get_attribute("title") or "")
    key = page.locator("#marks-key")
    assert key.get_attribute("open") is None
    assert not key.locator("dl").is_visible()
    key.locator("summary").click()
    assert key.locator("dl").is_visible()
    sample = key.locator(".key-invalid")
    assert _style(sample, "textDecorationStyle") == "wavy"
    assert _style(sample, "textDecorationColor") == _style(tab, "textDecorationColor")
    meaning = sample.locator("xpath=../following-sibling::dd[1]").inner_text()
    assert "wavy amber underline" in meaning and "not format-valid" in meaning
    # every kind of mark on the page has its sample in the key
    for selector in (
        ".tab-disagree",
        ".tab-origin.origin-hint",
        ".state-badge.tone-ok",
        ".state-badge.tone-warn",
        ".state-badge.tone-bad",
        ".format-problem",
        ".tok.near-miss",
        ".tok.tool-tok",
        ".turn-badge.tool",
        ".turn-state.tone-none",
        ".not-trained",
        ".flag-broken",
    ):
        assert key.locator(selector).count() >= 1, selector
    near = page.locator("#rollout-1 .tok.near-miss").first
    assert _style(near, "textDecorationStyle") == "wavy"
    _shot(page, "multiturn-format-and-key")


def test_per_turn_control_tables_are_folded_to_one_line(page: Any, served: Served) -> None:
    page.goto(f"/runs/{served.runs['multi']}/steps/1")
    tables = page.locator("#rollout-0 details.control-table")
    assert tables.count() == 5  # one per model turn
    for i in range(5):
        assert tables.nth(i).get_attribute("open") is None
        assert not tables.nth(i).locator("table.ctrl").is_visible()
    first = tables.nth(0).locator("summary")
    assert first.inner_text() == (
        "Control-token probabilities by position · max <tool> 0.02 @0, </tool> 0.02 @0, "
        "</assistant> 0.60 @2"
    )
    first.click()
    assert tables.nth(0).locator("table.ctrl").is_visible()
    assert tables.nth(1).get_attribute("open") is None
    _shot(page, "multiturn-turns")


def test_tool_results_read_as_formatted_json(page: Any, served: Served) -> None:
    page.goto(f"/runs/{served.runs['multi']}/steps/1")
    results = page.locator("#rollout-0 .tool-result")
    texts = results.all_text_contents()
    # TRL's str() of a tool error (a Python dict) reads as JSON; plain text stays text
    assert texts[2] == json.dumps({"error": "tool_47 cannot serve this request"}, indent=2)
    assert "json" in (results.nth(2).get_attribute("class") or "")
    assert texts[3] == "result: 48" and "json" not in (results.nth(3).get_attribute("class") or "")
    page.keyboard.press("2")
    formatted = page.locator("#rollout-2 .tool-result.json")
    expected = {"result": 31, "unit": "km", "notes": ["plausible", "<b>not</b> it"]}
    assert formatted.text_content() == json.dumps(expected, indent=2)
    assert formatted.locator("b").count() == 0  # the markup inside stays text
    _shot(page, "multiturn-json")


def test_a_run_recorded_before_says_its_vote_is_the_first_call(page: Any, served: Served) -> None:
    page.goto(f"/runs/{served.runs['legacy']}/steps/1")
    vote = page.locator("#rollout-0 .vote-stat")
    assert vote.locator(".label").inner_text() == "vote = first tool called"
    assert vote.locator(".value").inner_text() == "tool_00"
    final = page.locator("#rollout-0 .rollout-stats .stat").filter(has_text="final answer")
    assert final.locator(".value").inner_text() == "48"
    assert "the first tool it called" in page.locator("#vote-kind").inner_text()
    assert page.locator("#first-calls").count() == 0  # the votes are the first calls already
    row = page.locator("#group-table tbody tr").nth(0).locator(".vote-cell")
    assert row.inner_text().split("\n") == ["tool_00 (first call)", "answer 48"]
    out_of_calls = page.locator("#group-table tbody tr").nth(1).locator(".vote-cell")
    assert out_of_calls.inner_text().split("\n") == ["tool_00 (first call)", "no answer"]
    _shot(page, "multiturn-legacy")


def test_a_hint_says_whether_the_model_saw_it(page: Any, served: Served) -> None:
    page.goto(f"/runs/{served.runs['dataset_hint']}/steps/1")
    title = page.locator("#hint-title")
    assert title.inner_text().lower() == "hint in the dataset, not shown to the model"
    body = page.locator(".group-card .hint-body")
    assert body.inner_text() == DATASET_HINT.removeprefix("Hint: ")  # not "HINT: Hint: …"
    _shot(page, "hint-dataset")
    page.goto(f"/runs/{served.runs['supervised']}/steps/1")
    title = page.locator("#hint-title")
    assert "shown to the model in rollout #7" in title.inner_text().lower()
    page.keyboard.press("7")
    banner = page.locator("#rollout-7 .origin-banner")
    assert "Hint (shown to the model):" in banner.inner_text()
    assert banner.locator(".hint-text").inner_text() == HINT.removeprefix("Hint: ")
    _shot(page, "hint-shown")


SLATE = "rgb(241, 245, 249)"  # .shade-ratio .tok: nothing to compare
TOOL_GREY = "rgb(229, 231, 235)"  # .tok.tool-tok


def _cell_facts(page: Any, panel: str) -> list[dict[str, str]]:
    return list(
        page.eval_on_selector_all(
            f"{panel} .tokens [role=listitem]",
            """els => els.map(e => ({text: e.textContent, cls: e.className, title: e.title,
                bg: getComputedStyle(e).backgroundColor, ring: getComputedStyle(e).boxShadow}))""",
        )
    )


def test_tokens_shade_by_log_ratio_with_both_probabilities_on_hover(
    page: Any, served: Served
) -> None:
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    run_id = served.runs["two_sided"]
    page.goto(f"/runs/{run_id}/steps/1/groups/0")
    page.evaluate("window.sameDocument = true")  # gone if the switch reloaded the page
    by_p = _cell_facts(page, "#rollout-0")
    assert page.locator(".ratio-legend").first.is_hidden()
    page.click("#shade-switch a[data-shade=ratio]")
    assert "shade=ratio" in page.url and page.evaluate("window.sameDocument") is True
    assert "shade-ratio" in (page.locator("section.rollouts").get_attribute("class") or "")
    assert page.locator("#shade-switch a[data-shade=ratio]").get_attribute("aria-current") == "true"
    assert "shade=ratio" in (page.locator("#next-group").get_attribute("href") or "")
    by_r = _cell_facts(page, "#rollout-0")
    assert [c["text"] for c in by_r] == [c["text"] for c in by_p]
    assert page.locator(".ratio-legend").first.is_visible()
    assert page.locator(".token-legend:not(.ratio-legend)").first.is_hidden()
    ringed = 0
    for cell in by_r:
        assert "trainer p=" in cell["title"] and "generator p=" in cell["title"]
        assert "log r" in cell["title"]
        shade = cell["cls"].split()[-1]
        if shade == "rx":
            assert cell["bg"] == SLATE and "log r: —" in cell["title"]
        if shade[-1:] in ("3", "4"):  # outside [1/2, 2]: a ring, and the hover names the band
            ringed += 1
            assert cell["ring"] != "none" and "outside [1/" in cell["title"]
        else:
            assert cell["ring"] == "none"
    assert ringed and any(c["cls"].endswith(" rx") for c in by_r)
    changed = [p["bg"] != r["bg"] for p, r in zip(by_p, by_r, strict=True)]
    assert sum(changed) > len(changed) // 2
    # hostile token texts are text: shown as written, no element, no dialog
    texts = [c["text"].replace("·", " ") for c in by_r]
    assert HOSTILE_TOKENS[0] in texts
    assert page.locator(".tokens img, .tokens script").count() == 0
    _shot(page, "ratio")
    assert page.locator("form.jump #jump-shade").count() == 1  # the Go box keeps it too
    page.click("#shade-switch a[data-shade=probability]")
    assert "shade=" not in page.url and page.locator("#jump-shade").count() == 0
    assert [c["bg"] for c in _cell_facts(page, "#rollout-0")] == [c["bg"] for c in by_p]
    # a tool-calling group: tool results stay grey, not sampled, in either shade
    page.goto(f"/runs/{run_id}/steps/1/groups/1?shade=ratio")
    page.click("form.jump button[type=submit]")  # the Go box: the same step, still shaded
    page.wait_for_url("**/steps/1/groups/1?shade=ratio")
    tools = _cell_facts(page, "#rollout-0 li[data-turn=tool]")
    assert tools and all(c["cls"] == "tok tool-tok" and c["bg"] == TOOL_GREY for c in tools)
    model = _cell_facts(page, "#rollout-0 li[data-turn=model]")
    assert model and all("generator p=" in c["title"] for c in model)
    assert dialogs == []
