"""The HTML pages through an in-process client, on a real SQLite file and on PostgreSQL."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from rollout_lens.server import store
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.core.vocab import BELONGS, MISPLACED
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunStatus

from tests.factories import (
    CONTROL_TOKENS,
    make_rollouts,
    make_run,
    record_step,
    record_steps,
    step_record,
)
from tests.web_support import (
    COLLAPSE_STEP,
    HINT,
    PROBE_SPIKE_STEP,
    parse,
    record_collapse_run,
    record_supervised_run,
)

XSS = "<script>alert(1)</script></textarea>{{7*7}}\x07"


def test_runs_page_lists_runs_with_progress_and_links(session_factory, client) -> None:
    first = make_run(session_factory, steps=6, seed=1, name="patched a")
    second = make_run(session_factory, steps=4, seed=2, listed=64, name="leaky b", total_steps=40)
    with session_scope(session_factory) as session:
        store.mark_finished(session, run_id=first, status=RunStatus.completed)
    page = parse(client.get("/").text)
    rows = page.by_id("runs-table").find("tbody").find_all("tr")
    assert [r.attrs["data-run-id"] for r in rows] == [str(second), str(first)]  # newest first
    leaky = rows[0]
    assert leaky.find("a").attrs["href"] == f"/runs/{second}"
    assert leaky.find("a").text == "leaky b"
    assert leaky.find(cls="badge").text == "queued"
    bar = leaky.find("progress")
    assert (bar.attrs["value"], bar.attrs["max"]) == ("4", "40")
    assert rows[1].find(cls="badge").classes == {"badge", "status-completed"}
    cells = {
        td.attrs["data-field"]: td.text.strip()
        for td in leaky.find_all("td")
        if "data-field" in td.attrs
    }
    assert re.fullmatch(r"\d\.\d{3}", cells["recent_true_accuracy"])
    assert cells["cost"] == "$0.00"
    boxes = page.find("form", id="compare-form").find_all("input", type="checkbox", name="runs")
    assert sorted(b.attrs["value"] for b in boxes) == sorted([str(first), str(second)])
    assert page.by_id("compare-button").attrs["form"] == "compare-form"


def test_runs_page_sorts_filters_and_says_how_to_start(session_factory, client) -> None:
    empty = parse(client.get("/").text)
    assert "rollout-lens train" in empty.by_id("empty-state").text
    make_run(session_factory, steps=2, seed=1, name="beta run")
    make_run(session_factory, steps=2, seed=2, name="alpha run")
    by_name = parse(client.get("/?sort=name&order=asc").text)
    names = [
        a.text
        for a in by_name.by_id("runs-table").find_all("a")
        if a.attrs["href"].startswith("/runs/")
    ]
    assert names == ["alpha run", "beta run"]
    header = by_name.find("th", cls="sorted")
    assert header.attrs["aria-sort"] == "ascending"
    assert header.find("a").attrs["href"] == "/?sort=name&order=desc"
    filtered = parse(client.get("/?q=ALPHA").text)
    assert [
        r.attrs["data-run-id"] for r in filtered.by_id("runs-table").find("tbody").find_all("tr")
    ] == ["2"]
    nothing = client.get("/?q=gamma")
    assert "No run matches" in parse(nothing.text).find("section", cls="empty").text
    assert client.get("/?sort=bogus").status_code == 400


def test_run_page_shows_the_card_and_chart_specs(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=5, seed=3, name="card run")
    response = client.get(f"/runs/{run_id}")
    assert response.status_code == 200
    page = parse(response.text)
    assert page.find("h1").text.startswith("card run")
    facts = {
        f.find("dt").text: f.find("dd").text.strip()
        for f in page.by_id("run-card").find_all(cls="fact")
    }
    assert facts["model"] == "tiny"
    assert facts["steps"].startswith("5 / 5")
    assert facts["batch"] == "8 × 1 prompt"
    assert facts["seed"] == "3"
    assert facts["status"] == "queued"
    config = {
        r.find("th").text: r.find("td").text for r in page.find("table", cls="kv").find_all("tr")
    }
    assert config["learning_rate"] == "0.0003"
    data = page.json("page-data")
    ids = [f["id"] for f in data["figures"]["main"]]
    assert ids == ["reward", "buckets", "votes", "format", "control"]
    assert data["series"] == f"/api/runs/{run_id}/series"
    assert data["active"] is True  # queued counts as live
    for fig in data["figures"]["main"]:
        assert page.by_id(f"fig-{fig['id']}").tag == "div"
    control = next(f for f in data["figures"]["main"] if f["id"] == "control")
    assert {t["meta"]["series"] for t in control["data"]} == {"ctrl/</assistant>/max"}  # as logged
    assert data["figures"]["other"] == [] and data["figures"]["structure"] == []  # not logged
    assert page.find("a", cls="primary").attrs["href"] == f"/runs/{run_id}/steps/5"


def test_external_runs_say_where_they_came_from_and_what_was_dropped(
    session_factory, client
) -> None:
    from rollout_lens.server.store.models import RunSource

    note = "<script>alert(1)</script> no control-token probabilities"
    judged = {"vote": False, "true_score": True, "format_valid": False}
    external = make_run(
        session_factory,
        steps=2,
        seed=4,
        name="user run",
        source=RunSource.callback,
        notes=[note],
        config={"judged": judged},
    )
    launched = make_run(session_factory, steps=2, seed=5, name="our run")
    with session_scope(session_factory) as session:
        store.set_dropped(session, run_id=external, steps=2, rollouts=16)

    page = parse(client.get(f"/runs/{external}").text)
    source = page.by_id("run-card").find("dd", **{"data-field": "source"})
    assert "external" in source.text and "RolloutLensCallback" in source.text
    assert "16 rollouts and 2 whole steps were dropped" in page.by_id("recording-gap").text
    assert [li.text for li in page.find("ul", cls="recording-notes").find_all("li")] == [note]
    assert "<script>alert(1)" not in client.get(f"/runs/{external}").text  # escaped

    # no vote function given: the viewer says so instead of calling every completion malformed
    viewer = client.get(f"/runs/{external}/steps/1").text
    assert "No votes recorded" in viewer and "malformed" not in viewer
    assert "No votes recorded" not in client.get(f"/runs/{launched}/steps/1").text

    ours = parse(client.get(f"/runs/{launched}").text)
    assert ours.by_id("run-card").find("dd", **{"data-field": "source"}).text == "launched here"
    assert "recording-gap" not in client.get(f"/runs/{launched}").text
    listing = parse(client.get("/").text)
    badges = {
        row.attrs["data-run-id"]: [b.text for b in row.find_all("span", cls="external")]
        for row in listing.find_all("tr")
        if "data-run-id" in row.attrs
    }
    assert badges == {str(external): ["external"], str(launched): []}


def test_assets_are_local(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=2)
    for url in ("/", f"/runs/{run_id}", f"/runs/{run_id}/steps/1", "/docs"):
        page = parse(client.get(url).text)
        sources = [
            n.attrs.get("src") or n.attrs.get("href")
            for n in page.find_all("script") + page.find_all("link")
        ]
        sources = [s for s in sources if s]
        assert sources, url
        assert all(s.startswith("/static/") for s in sources), sources
        for source in sources:
            assert client.get(source).status_code == 200, source
    assert "/static/vendor/plotly-cartesian-4.1.1.min.js" in client.get(f"/runs/{run_id}").text


def test_step_viewer_shows_the_group(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=3, seed=5)
    page = parse(client.get(f"/runs/{run_id}/steps/2").text)
    assert page.by_id("step-number").text == "2"
    group = page.find("aside", cls="group-card")
    assert group.find("p", cls="query").text == "17 * 38"
    target = group.find("code", cls="target").text
    votes = group.find("ul", cls="votes").find_all("li")
    assert sum(int(v.find(cls="vote-count").text) for v in votes) == 8
    assert sum(1 for v in votes if "target" in v.classes) <= 1
    if any("target" in v.classes for v in votes):
        assert next(v for v in votes if "target" in v.classes).find(cls="vote-id").text == target
    tabs = page.find_all("button", role="tab")
    assert [t.text.strip()[:2] for t in tabs] == [f"#{i}" for i in range(8)]
    assert tabs[0].attrs["aria-selected"] == "true"
    panels = page.find_all(role="tabpanel")
    assert len(panels) == 8 and "hidden" not in panels[0].attrs and "hidden" in panels[1].attrs
    panel = panels[3]
    stats = {
        s.find(cls="label").text: s.find(cls="value").text.strip()
        for s in panel.find_all(cls="stat")
    }
    assert set(stats) == {
        "verifier reward",
        "true score",
        "advantage",
        "Σ logprob",
        "vote",
        "format",
    }
    assert stats["format"] == "healthy_call"
    tokens = panel.find("div", cls="tokens").find_all("span", cls="tok")
    # The factory's ids are [<tool>, id, </tool>, end-of-turn]: the text gives three, the id the last.
    assert [t.text for t in tokens] == ["<tool>", stats["vote"], "</tool>", "⟨2⟩"]
    assert all(re.fullmatch(r"p\d", c) for t in tokens for c in t.classes - {"tok", "near-miss"})
    assert "p(</assistant>)=" in tokens[0].attrs["title"]
    ctrl = panel.find("table", cls="ctrl")
    assert [th.text for th in ctrl.find("tbody").find_all("th")] == ["sampled", *CONTROL_TOKENS]
    prompt = page.by_id("prompt")
    assert "4 tools listed" in prompt.find("summary").text
    assert prompt.find("pre").text.startswith("<user>Tools:")


def test_step_viewer_navigation(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=5)
    page = parse(client.get(f"/runs/{run_id}/steps/3").text)
    links = {a.attrs["id"]: a.attrs.get("href") for a in page.by_id("step-nav").find_all("a")}
    assert links == {
        "first-step": f"/runs/{run_id}/steps/1",
        "prev-step": f"/runs/{run_id}/steps/2",
        "next-step": f"/runs/{run_id}/steps/4",
        "last-step": f"/runs/{run_id}/steps/5",
        "step-rollouts": f"/runs/{run_id}/rollouts?steps=3",  # the step in the explorer
        "step-prompts": f"/runs/{run_id}/prompts",  # the run's prompts over its steps
    }
    slider = page.by_id("step-slider")
    assert (slider.attrs["min"], slider.attrs["max"], slider.attrs["value"]) == ("1", "5", "3")
    assert page.find("form", cls="jump").attrs["action"] == f"/runs/{run_id}/steps"
    first = parse(client.get(f"/runs/{run_id}/steps/1").text)
    assert "href" not in first.by_id("prev-step").attrs
    jump = client.get(f"/runs/{run_id}/steps?step=99", follow_redirects=False)
    assert jump.status_code == 303 and jump.headers["location"] == f"/runs/{run_id}/steps/5"
    exact = client.get(f"/runs/{run_id}/steps?step=3", follow_redirects=False)
    assert exact.headers["location"] == f"/runs/{run_id}/steps/3"


def test_missing_step_is_a_404_that_links_to_the_nearest(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=3)
    record_step(session_factory, run_id, 10, values={"loss": 0.1})
    response = client.get(f"/runs/{run_id}/steps/8")
    assert response.status_code == 404
    page = parse(response.text)
    assert "no step 8" in page.find(cls="error-message").text
    assert page.find("a", cls="primary").attrs["href"] == f"/runs/{run_id}/steps/10"
    assert (
        parse(client.get(f"/runs/{run_id}/steps/5").text).find("a", cls="primary").text
        == "Go to step 3"
    )
    api = client.get(f"/api/runs/{run_id}/steps/8")
    assert api.status_code == 404 and api.json()["nearest_step"] == 10
    empty_step = parse(client.get(f"/runs/{run_id}/steps/10").text)
    assert "No rollouts at this step" in empty_step.find("section", cls="empty").text


def test_errors_render_as_pages_or_json(session_factory, client) -> None:
    page = client.get("/runs/404")
    assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
    assert "run 404 does not exist" in parse(page.text).find(cls="error-message").text
    api = client.get("/api/runs/404")
    assert api.status_code == 404 and api.json() == {"detail": "run 404 does not exist"}
    assert client.get("/no/such/page").status_code == 404
    invalid = client.get("/runs/abc")
    assert (
        invalid.status_code == 422
        and "run_id" in parse(invalid.text).find(cls="error-message").text
    )
    assert client.get("/api/runs/abc").json()["detail"].startswith("invalid request: run_id")


def _only_our_scripts(html: str) -> None:
    for script in parse(html).find_all("script"):
        assert (
            script.attrs.get("src", "").startswith("/static/")
            or script.attrs.get("type") == "application/json"
        )
        assert "alert(" not in script.text


def test_untrusted_text_is_inert(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=2, completion=XSS, name="<b>bold</b> & {{ name }}")
    other = make_run(session_factory, steps=2)
    for url in (
        f"/runs/{run_id}/steps/1",
        f"/compare?runs={run_id},{other}",
        f"/runs/{run_id}",
        "/",
        f"/runs/{run_id}/steps/1/card",
    ):
        html = client.get(url).text
        assert (
            "<script>alert(1)" not in html and "</textarea>{{" not in html and "<b>bold" not in html
        ), url
        _only_our_scripts(html)
        assert not parse(html).find_all("textarea") and not parse(html).find_all("b"), url
    step = parse(client.get(f"/runs/{run_id}/steps/1").text)
    completion = step.find("pre", cls="completion")
    assert completion.text == "<script>alert(1)</script></textarea>{{7*7}}␇"  # as text, not run
    assert completion.find(cls="cc").attrs["title"] == "control character U+0007"
    run_page = client.get(f"/runs/{run_id}").text
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; {{ name }}" in run_page
    compare = client.get(f"/compare?runs={run_id},{other}").text
    # Chart JSON escapes < and &, so a run name cannot close the <script> that holds it.
    assert "\\u0026lt;b\\u0026gt;bold" in compare
    names = {
        t["name"]
        for f in parse(compare).json("page-data")["figures"]
        for t in f["data"]
        if "name" in t
    }
    assert (
        f"#{run_id} &lt;b&gt;bold&lt;/b&gt; &amp; {{{{ name }}}}" in names
    )  # Plotly reads tags in names
    api = client.get(f"/api/runs/{run_id}/steps/1/groups/0").json()
    assert api["rollouts"][0]["completion"] == XSS


def test_compare_page(session_factory, client) -> None:
    a = make_run(session_factory, steps=6, seed=1, name="run a")
    b = make_run(
        session_factory, steps=4, seed=2, listed=64, name="run b", config={"learning_rate": 1e-3}
    )
    page = parse(client.get(f"/compare?runs={a},{b}").text)
    rows = page.find("table", cls="summary").find("tbody").find_all("tr")
    assert [r.find("a").text for r in rows] == [f"#{a} run a", f"#{b} run b"]
    diff = {
        r.find("th").text: [td.text for td in r.find_all("td")]
        for r in page.find("table", cls="diff").find("tbody").find_all("tr")
    }
    assert diff["learning_rate"] == ["0.0003", "0.001"]
    assert diff["variant"] == ['"patched"', '"leaky"']
    assert "total_steps" in diff and "model" not in diff
    changed = page.find("table", cls="diff").find_all("td", cls="changed")
    assert changed and all(
        "changed" not in r.find_all("td")[0].classes
        for r in page.find("table", cls="diff").find("tbody").find_all("tr")
    )
    data = page.json("page-data")
    assert data["step"] == 4 and data["max_step"] == 6 and data["pair"] == [a, b]
    assert {tuple(sorted({t["meta"]["run"] for t in f["data"]})) for f in data["figures"]} == {
        (a, b)
    }
    cards = page.find_all("div", cls="pair-body")
    assert [c.find(cls="step-card").attrs["data-step"] for c in cards] == ["4", "4"]
    moved = parse(client.get(f"/compare?runs={a},{b}&step=6").text)
    assert "has no step 6" in moved.find_all("div", cls="pair-body")[1].text
    card = client.get(f"/runs/{a}/steps/5/card")
    assert (
        card.status_code == 200 and parse(card.text).find(cls="step-card").attrs["data-step"] == "5"
    )
    same_form = client.get(f"/compare?runs={a}&runs={b}")
    assert same_form.status_code == 200


def test_compare_needs_two_runs_and_says_what_three_show(session_factory, client) -> None:
    ids = [make_run(session_factory, steps=2, seed=i) for i in range(3)]
    assert client.get(f"/compare?runs={ids[0]}").status_code == 400
    assert client.get("/compare?runs=x,y").status_code == 400
    assert client.get(f"/compare?runs={ids[0]},999").status_code == 404
    page = parse(client.get(f"/compare?runs={','.join(map(str, ids))}").text)
    assert len(page.find("table", cls="summary").find("tbody").find_all("tr")) == 3
    assert "first two runs" in page.by_id("side-by-side").find(cls="note").text
    assert len(page.find_all("div", cls="pair-body")) == 2


def test_step_with_several_groups_opens_on_its_groups(session_factory, client) -> None:
    run_id = make_run(session_factory, steps=1, prompts_per_step=2)
    first, second = make_rollouts(random.Random(1)), make_rollouts(random.Random(2))
    for rollout in second:
        rollout.group = 1
        rollout.meta = rollout.meta | {"query": "define ephemeral"}
    record_step(session_factory, run_id, 2, rollouts=first + second)
    page = parse(client.get(f"/runs/{run_id}/steps/2").text)
    links = [a.attrs["href"] for a in page.by_id("groups-table").find_all("a", cls="group-link")]
    assert links == [f"/runs/{run_id}/steps/2/groups/{g}" for g in (0, 1)]
    other = parse(client.get(f"/runs/{run_id}/steps/2/groups/1").text)
    assert other.find("aside", cls="group-card").find("p", cls="query").text == "define ephemeral"
    assert client.get(f"/runs/{run_id}/steps/2/groups/2").status_code == 404
    assert len(client.get(f"/api/runs/{run_id}/steps/2").json()["groups"]) == 2


def test_run_page_shows_alerts_states_probes_evaluation_and_sft(session_factory, client) -> None:
    run_id = record_collapse_run(session_factory)
    overview = client.get(f"/api/runs/{run_id}").json()
    alerts = [(a["kind"], a["step"]) for a in overview["alerts"]]
    assert alerts == [("control_token_spike", PROBE_SPIKE_STEP), ("collapse", COLLAPSE_STEP)]
    assert all(set(a) >= {"kind", "step", "message"} for a in overview["alerts"])
    page = parse(client.get(f"/runs/{run_id}").text)
    items = page.by_id("alert-list").find_all("li")
    assert [li.find("a").attrs["href"] for li in items] == [
        f"/runs/{run_id}/steps/{PROBE_SPIKE_STEP}",
        f"/runs/{run_id}/steps/{COLLAPSE_STEP}",
    ]
    assert "hidden" not in page.by_id("alerts").attrs and page.by_id("alert-count").text == "2"
    data = page.json("page-data")
    assert data["initial_alerts"] == overview["alerts"]
    assert [f["id"] for f in data["figures"]["structure"]] == ["probes", "states", "ids"]
    states = next(f for f in data["figures"]["structure"] if f["id"] == "states")
    assert [t["meta"]["series"] for t in states["data"]] == [
        "state/healthy_call",
        "state/text_pollution",
        "state/collapse",
        "state/no_call",
    ]
    assert {t["stackgroup"] for t in states["data"]} == {"state"}
    probes = data["figures"]["probes"]
    assert [f["id"] for f in probes][:2] == ["probe-eot_after_open", "probe-close_after_id"]
    assert len(probes) == 7  # four positional probes, three at the id position
    eot_parts = {t["meta"]["series"].split("/", 2)[2] for t in probes[0]["data"]}
    assert eot_parts == {"mean", "p90", "max", "reward1/mean", "reward0/mean", "policy/mean"}
    assert [f["id"] for f in data["figures"]["evaluation"]] == ["eval", "sft"]
    assert data["sft_series"] == "sft/loss" and data["sft_before_rl"] is False
    assert page.by_id("sft-note") and page.by_id("probe-key")
    for section in ("charts-structure", "charts-probes", "charts-evaluation"):
        assert page.by_id(section).find_all("figure")


def test_run_page_charts_evaluation_before_the_first_one(session_factory, client) -> None:
    # A run that evaluates every 25 steps has no eval/* series at step 3, and its SFT phases
    # none before step 25: the charts are there already, filled when the points arrive.
    run_id = make_run(
        session_factory,
        steps=3,
        status=RunStatus.running,
        config={"eval_every": 25, "supervision": "sft_then_rl"},
    )
    data = parse(client.get(f"/runs/{run_id}").text).json("page-data")
    assert [f["id"] for f in data["figures"]["evaluation"]] == ["eval", "sft"]
    assert data["sft_before_rl"] is True


def test_step_viewer_marks_supervised_rollouts(session_factory, client) -> None:
    run_id = record_supervised_run(session_factory)
    page = parse(client.get(f"/runs/{run_id}/steps/2").text)
    tabs = page.find_all("button", role="tab")
    assert [t.attrs.get("data-origin") for t in tabs] == [None] * 6 + ["expert", "hint"]
    assert tabs[6].find(cls="tab-origin").text == "expert" and "supervised" in tabs[7].classes
    expert, hinted = page.by_id("rollout-6"), page.by_id("rollout-7")
    assert "Expert reply" in expert.find(cls="origin-banner").text
    banner = hinted.find(cls="origin-banner")
    assert "stripped before the update" in banner.text
    assert banner.find(cls="hint-text").text == HINT.removeprefix("Hint: ")  # labelled once
    assert not page.by_id("rollout-0").find_all(cls="origin-banner")
    summary = page.by_id("supervised-summary").text
    assert "1 × expert" in summary and "1 × hint" in summary
    card = parse(client.get(f"/runs/{run_id}/steps/2/card").text)
    assert [s.text for s in card.find_all(cls="tab-origin")] == ["expert", "hint"]


def test_compare_summary_has_the_final_evaluation(session_factory, client) -> None:
    first = record_collapse_run(session_factory, name="a")
    plain = make_run(session_factory, steps=5, seed=2)
    page = parse(client.get(f"/compare?runs={first},{plain}").text)
    headers = [th.text for th in page.find("table", cls="summary").find_all("th")]
    assert headers[-5:] == [
        "Eval: training queries",
        "Eval: other reply format",
        "Eval: paraphrased queries",
        "Device-min",
        "Cost",
    ]
    cells = page.find_all("td", data_eval="eval/id")
    assert cells[0].find("span").attrs["title"] == "at step 120" and cells[1].text.strip() == "—"
    summary = client.get(f"/api/compare?runs={first},{plain}").json()["summary"]
    assert summary[0]["final_eval"]["eval/format_ood"]["step"] == 120
    assert summary[1]["final_eval"] == {
        "eval/id": None,
        "eval/format_ood": None,
        "eval/content_ood": None,
        "eval/validation": None,
    }
    assert page.by_id("charts-evaluation") and page.by_id("charts-collapse")


def test_alerts_of_many_runs_for_the_runs_list(session_factory, client) -> None:
    collapsed = record_collapse_run(session_factory)
    calm = make_run(session_factory, steps=3)
    data = client.get(f"/api/alerts?runs={collapsed},{calm},999").json()
    assert set(data) == {str(collapsed), str(calm)} and data[str(calm)] == []
    assert [a["url"] for a in data[str(collapsed)]] == [
        f"/runs/{collapsed}/steps/{PROBE_SPIKE_STEP}",
        f"/runs/{collapsed}/steps/{COLLAPSE_STEP}",
    ]
    page = parse(client.get("/").text)
    assert page.json("page-data")["alerts"] == "/api/alerts"
    assert page.find("tr", data_run_id=str(collapsed)).find(cls="alerts-slot")


def _record_converging_run(session_factory, *, solved: bool) -> int:
    """A patched run of two groups a step, recorded from its rollouts as the trainer summarizes
    them: learning for 29 steps, then every rollout right (`solved`) or every one wrong."""
    from rollout_lens.trainer.recorder.summary import summarize

    rng = random.Random(11)
    run_id = make_run(session_factory, steps=0, prompts_per_step=2)

    def records() -> Iterator[StepRecord]:
        for step in range(1, 81):
            rollouts = make_rollouts(rng) + make_rollouts(rng)
            for i, r in enumerate(rollouts):
                r.group = i // 8
                if step >= 30:
                    r.vote = r.target if solved else "none_of_them"
                    r.verifier_reward = r.true_score = float(solved)
            values, metrics = summarize(rollouts, 8, CONTROL_TOKENS)
            metrics |= {f"probe/{p}/mean": 0.01 for p in MISPLACED}
            metrics |= {f"probe/{p}/mean": 0.98 for p in BELONGS}
            yield step_record(step, values=values, rollouts=rollouts, metrics=metrics)

    record_steps(session_factory, run_id, records())
    return run_id


def test_a_healthy_converged_run_shows_no_warning(session_factory, client) -> None:
    converged = _record_converging_run(session_factory, solved=True)
    stuck = _record_converging_run(session_factory, solved=False)
    # no reward spread left in either: what the zero-std rule alone would call signal loss
    for run_id in (converged, stuck):
        zero_std = client.get(f"/api/runs/{run_id}/series?names=zero_std_share").json()
        assert zero_std["series"]["zero_std_share"]["y"][-1] == 1.0
    alerts = client.get(f"/api/runs/{converged}/alerts").json()
    assert [(a["kind"], a["severity"]) for a in alerts] == [("solved", "info")]
    page = parse(client.get(f"/runs/{converged}").text)
    assert page.by_id("warning-count").text == "0 warnings"
    assert page.by_id("alert-count").text == "1"
    assert "severity-info" in page.by_id("alert-list").find("li").classes

    alerts = client.get(f"/api/runs/{stuck}/alerts").json()
    assert [(a["kind"], a["severity"], a["series"]) for a in alerts] == [
        ("signal_loss", "warning", "groups/stuck")
    ]
    assert parse(client.get(f"/runs/{stuck}").text).by_id("warning-count").text == "1 warning"

    # the runs list counts warnings from one grouped query: none for the converged run
    runs = parse(client.get("/").text)
    slot = runs.find("tr", data_run_id=str(converged)).find(cls="alerts-slot")
    assert slot.text.strip() == ""
    slot = runs.find("tr", data_run_id=str(stuck)).find(cls="alerts-slot")
    assert slot.text.strip() == "⚠ 1"
    listed = {r["id"]: r["warnings"] for r in client.get("/api/runs").json()["runs"]}
    assert listed[converged] == 0 and listed[stuck] == 1
