"""The mismatch lens on the pages, through an in-process client on a real SQLite file: a run
recorded through the store with the generator's logprobs (single-turn and tool-calling groups)
shades its tokens by log r on request, shows each rollout's figures beside Σ logprob and sends
them in the group's JSON twin; its run page and compare have the mismatch chart section, which
a run without the series does not."""

from __future__ import annotations

import math
import random
import re
from typing import Any

import pytest
from rollout_lens.server.core import mismatch as mm
from rollout_lens.server.core.records import RolloutRecord
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.webapp.pages.cells import prob_text

from tests.factories import (
    CONTROL_TOKENS,
    make_rollouts,
    make_tool_rollouts,
    record_step,
    with_generator,
)
from tests.web_support import Node, parse

RATIO_CLASSES = {"r0", "rx", *(f"r{s}{i}" for s in "pn" for i in range(1, 5))}
MASKS = (re.compile(r'nonce="[^"]*"'), re.compile(r'content="[^"]*"'), re.compile(r'value="[^"]*"'))


def _run(factory: Any, name: str, *, generator: bool) -> int:
    from rollout_lens.server import store

    with session_scope(factory) as session:
        run_id = store.create_run(
            session, name=name, model="tiny", total_steps=2, group_size=8,
            control_tokens=CONTROL_TOKENS,
        ).id  # fmt: skip
    rng = random.Random(47)
    single = make_rollouts(rng)
    tools = make_tool_rollouts(3)
    for r in tools:
        r.group = 1
    if generator:
        with_generator(single[:-1], rng, spread=2.0, none_every=3)  # the last: a path without
        with_generator(tools, rng, spread=2.0)
    metrics = _figures(single + tools) if generator else {}
    record_step(factory, run_id, 1, rollouts=single + tools, values={"reward_mean": 0.5}, metrics=metrics)  # fmt: skip
    second = make_rollouts(rng)
    if generator:
        with_generator(second, rng, spread=0.5)
    record_step(factory, run_id, 2, rollouts=second, values={"reward_mean": 0.5}, metrics=_figures(second) if generator else {})  # fmt: skip
    return run_id


def _figures(rollouts: list[RolloutRecord]) -> dict[str, float | None]:
    sides = [mm.Sides(r.token_logprobs, r.generator_logprobs) for r in rollouts]
    return dict(mm.step_figures(sides))


@pytest.fixture
def runs(session_factory: Any) -> dict[str, int]:
    return {
        "two": _run(session_factory, "two-sided", generator=True),
        "plain": _run(session_factory, "plain", generator=False),
    }


def _brute(rollout: dict[str, Any]) -> tuple[int, float, float] | None:
    """A rollout's figures from its whole JSON arrays (null: no generator logprob), by hand."""
    pairs = zip(rollout["token_logprobs"], rollout["generator_logprobs"], strict=True)
    diffs = [t - g for t, g in pairs if g is not None]
    if not diffs:
        return None
    return len(diffs), max(abs(d) for d in diffs), math.exp(math.fsum(diffs))


def _group_json(client: Any, run_id: int, group: int, **params: Any) -> list[dict[str, Any]]:
    answer = client.get(f"/api/runs/{run_id}/steps/1/groups/{group}", params=params)
    assert answer.status_code == 200, answer.text
    rollouts: list[dict[str, Any]] = answer.json()["rollouts"]
    return rollouts


def test_the_json_twin_sends_each_rollouts_figures_over_all_its_positions(client, runs) -> None:
    for group in (0, 1):
        whole = _group_json(client, runs["two"], group)
        cut = _group_json(client, runs["two"], group, max_tokens=2)  # a window of two positions
        for full, window in zip(whole, cut, strict=True):
            assert len(window["completion_ids"]) == 2 < full["tokens_total"]
            if full["generator_logprobs"] is None:
                assert "mismatch" not in full and "mismatch" not in window
                continue
            n, biggest, ratio = _brute(full) or (0, 0.0, 0.0)
            assert window["mismatch"] == full["mismatch"]  # the whole rollout's, not the window's
            assert full["mismatch"]["tokens"] == n
            assert full["mismatch"]["abs_diff_max"] == pytest.approx(biggest, abs=1e-9)
            assert full["mismatch"]["seq_ratio"] == pytest.approx(ratio, rel=1e-9)
    for group in (0, 1):
        assert all("mismatch" not in r for r in _group_json(client, runs["plain"], group))


def _rollouts(page: Node) -> Node:
    (section,) = page.find_all("section", cls="rollouts")
    return section


def _cells(panel: Node) -> list[Node]:
    return panel.find("div", cls="tokens").find_all("span", role="listitem")


def test_the_group_page_shades_by_log_ratio_on_request(client, runs) -> None:
    url = f"/runs/{runs['two']}/steps/1/groups/0"
    by_p = parse(client.get(url).text)
    assert "shade-ratio" not in _rollouts(by_p).classes
    links = {a.attrs["data-shade"]: a for a in by_p.by_id("shade-switch").find_all("a")}
    assert links["ratio"].attrs["href"] == "?shade=ratio"
    assert (links["probability"].attrs["aria-current"], links["ratio"].attrs["aria-current"]) == ("true", "false")  # fmt: skip
    by_r = parse(client.get(url, params={"shade": "ratio"}).text)
    assert "shade-ratio" in _rollouts(by_r).classes
    links = {a.attrs["data-shade"]: a for a in by_r.by_id("shade-switch").find_all("a")}
    assert links["ratio"].attrs["aria-current"] == "true"
    json_rollouts = _group_json(client, runs["two"], 0)
    for i, rollout in enumerate(json_rollouts):
        panel = by_r.by_id(f"rollout-{i}")
        stats = {
            s.find(cls="label").text: (s.find(cls="value").text, s.attrs.get("title", ""))
            for s in panel.find("div", cls="rollout-stats").find_all(cls="stat")
        }
        cells = _cells(panel)
        if rollout["generator_logprobs"] is None:  # a rollout of the group without one
            assert "max |Δlogp|" not in stats
            assert not [c for c in cells if c.classes & RATIO_CLASSES]  # its probability's alone
            assert "no generator logprobs" in panel.find(cls="ratio-legend").text
            continue
        n, biggest, ratio = _brute(rollout) or (0, 0.0, 0.0)
        assert stats["max |Δlogp|"][0] == f"{biggest:.3g}" and f"its {n} compared" in stats["max |Δlogp|"][1]  # fmt: skip
        assert stats["seq. ratio"][0] == f"{ratio:.3g}"
        assert len(cells) == len(rollout["completion_ids"])
        for cell, t, g in zip(cells, rollout["token_logprobs"], rollout["generator_logprobs"], strict=True):  # fmt: skip
            title = cell.attrs["title"]
            assert f"trainer p={prob_text(math.exp(t), 3)} · generator p=" in title
            if g is None:
                assert "rx" in cell.classes and "log r: —" in title
            else:
                shade = next(c for c in cell.classes if re.fullmatch(r"r0|r[pn][1-4]", c))
                assert shade == _shade(t - g)
                assert f"log r={t - g:+.3f}" in title and "generator p=" in title
        legend = panel.find(cls="ratio-legend")
        assert [s.classes - {"tok"} for s in legend.find(cls="scale").find_all("span")][-1] == {
            "rx"
        }


def _shade(log_r: float) -> str:
    """The shade a log r gets, from the bands as mismatch counts them (by hand)."""
    size = abs(log_r)
    if size <= 0.01:
        return "r0"
    level = 1 + (size > 0.1) + bool(mm.outside([log_r], 2.0)[0]) + bool(mm.outside([log_r], 5.0)[0])  # fmt: skip
    return f"{'rp' if log_r > 0 else 'rn'}{level}"


def test_tool_results_stay_neutral_and_the_step_viewer_keeps_the_shade(client, runs) -> None:
    page = parse(client.get(f"/runs/{runs['two']}/steps/1/groups/1?shade=ratio").text)
    panel = page.by_id("rollout-0")
    tool_cells = [c for t in panel.find_all("li", data_turn="tool") for c in t.find_all("span", role="listitem")]  # fmt: skip
    assert tool_cells and all(c.classes == {"tok", "tool-tok"} for c in tool_cells)
    model_cells = [c for t in panel.find_all("li", data_turn="model") for c in t.find_all("span", role="listitem")]  # fmt: skip
    assert model_cells and all("generator p=" in c.attrs["title"] for c in model_cells)
    # the jump box and the step_jump redirect keep the shade (the prev/next links: step.js)
    assert page.by_id("jump-shade").attrs["value"] == "ratio"
    params = {"step": 1, "group": 1, "shade": "ratio"}
    jump = client.get(f"/runs/{runs['two']}/steps", params=params, follow_redirects=False)
    assert jump.status_code == 303
    assert jump.headers["location"] == f"/runs/{runs['two']}/steps/1/groups/1?shade=ratio"
    plain_jump = client.get(f"/runs/{runs['two']}/steps", params={"step": 1, "group": 1}, follow_redirects=False)  # fmt: skip
    assert plain_jump.headers["location"] == f"/runs/{runs['two']}/steps/1/groups/1"
    single = parse(client.get(f"/runs/{runs['two']}/steps/2", params={"shade": "ratio"}).text)
    assert "shade-ratio" in _rollouts(single).classes  # a step of one group: its page
    assert client.get(f"/runs/{runs['two']}/steps/2", params={"shade": "odd"}).status_code == 422


def _masked(body: str) -> str:
    for pattern in MASKS:
        body = pattern.sub("MASKED", body)
    return body


def test_a_run_without_generator_logprobs_has_no_switch_and_no_mismatch_section(client, runs) -> None:  # fmt: skip
    url = f"/runs/{runs['plain']}/steps/1/groups/0"
    page = parse(client.get(url).text)
    assert not page.find_all(id="shade-switch") and not page.find_all(cls="ratio-legend")
    assert "shade-ratio" not in _rollouts(page).classes
    assert not [s for s in page.find_all(cls="stat") if "Δlogp" in s.text]
    asked = client.get(url, params={"shade": "ratio"}).text
    assert _masked(asked) == _masked(client.get(url).text)  # nothing to shade by log r
    plain = parse(client.get(f"/runs/{runs['plain']}").text)
    assert not plain.find_all(id="charts-mismatch")
    assert plain.json("page-data")["figures"]["mismatch"] == []
    both_plain = parse(client.get("/compare", params={"runs": f"{runs['plain']},{runs['plain']}"}).text)  # fmt: skip
    assert not both_plain.find_all(id="charts-mismatch")


def test_the_run_page_and_compare_show_the_mismatch_section_with_the_series(client, runs) -> None:
    page = parse(client.get(f"/runs/{runs['two']}").text)
    section = page.by_id("charts-mismatch")
    assert [f.attrs["data-figure"] for f in section.find_all("figure")] == [
        "mismatch-diff",
        "mismatch-k3",
        "mismatch-seq",
        "mismatch-bands",
    ]
    assert "≥ 0.01" in page.by_id("text-mismatch").text
    data = page.json("page-data")
    assert "mismatch" in [s["group"] for s in data["sections"]]
    assert not [g for g in data["figures"]["other"] if g["title"] == "mismatch"]
    series = client.get(f"/api/runs/{runs['two']}/series", params={"names": mm.K3_KL}).json()
    assert len(series["series"][mm.K3_KL]["x"]) == 2
    compare = parse(client.get("/compare", params={"runs": f"{runs['two']},{runs['plain']}"}).text)
    titles = [f.find(cls="chart-title").text for f in compare.by_id("charts-mismatch").find_all("figure")]  # fmt: skip
    assert len(titles) == len(mm.NAMES) and "k3 KL(generator ‖ trainer)" in titles
