"""The mismatch drill-down (/runs/{id}/mismatch and /api/runs/{id}/mismatch, issue 47) against
brute force over the stored arrays: a step and a range (and a range cut by its bounds), a run
without a generator side, the parameters it refuses, hostile token text escaped, the links from
the step page and from a mismatch alert (page, JSON and webhook), and its figures valid Plotly."""

from __future__ import annotations

import math
from typing import Any

import pytest
from rollout_lens.server.core import mismatch_drill
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import AlertRow, RunRow
from rollout_lens.server.webapp import alert_hooks
from rollout_lens.server.webapp.queries import mismatch_page
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import make_run
from tests.mismatch_support import HOSTILE, mismatch_run, stored_figures
from tests.web.test_figure_schema import figures_in, validate
from tests.web_support import client_for, parse


@pytest.fixture
def drilled(session_factory: sessionmaker[Session]) -> tuple[int, list[dict[str, Any]]]:
    """A run of 5 steps with a hostile token far off in some rollouts, and its stored rows in
    (step, group, index) order."""
    run_id = mismatch_run(session_factory, steps=5, hostile=True, seed=3)
    rows = sorted(
        stored_figures(session_factory, run_id).values(),
        key=lambda r: (r["step"], r["group"], r["index"]),
    )
    return run_id, rows


def _brute(rows: list[dict[str, Any]], steps: set[int]) -> list[tuple[Any, ...]]:
    """(step, group, index, position, log r, generator logprob) of every compared token."""
    out = []
    for r in rows:
        if r["step"] not in steps or r["generator"] is None or r["abs_diff_max"] is None:
            continue
        for at, (t, g) in enumerate(zip(r["trainer"], r["generator"], strict=True)):
            if math.isfinite(t) and math.isfinite(g):
                out.append((r["step"], r["group"], r["index"], at, t - g, g))
    return out


def _check_against(data: dict[str, Any], tokens: list[tuple[Any, ...]]) -> None:
    assert data["tokens"] == len(tokens) > 0
    hist = data["histogram"]
    assert sum(hist["counts"]) + hist["below"] + hist["above"] == len(tokens)
    log_r = [t[4] for t in tokens]
    k3 = sum(math.exp(x) - 1 - x for x in log_r) / len(log_r)
    assert data["figures"]["mismatch/k3_kl"] == pytest.approx(k3, rel=1e-9)
    worst = sorted(tokens, key=lambda t: (-abs(t[4]), t[0], t[1], t[2], t[3]))
    shown = [(w["step"], w["group"], w["index"], w["position"]) for w in data["worst"]]
    assert shown == [t[:4] for t in worst[: mismatch_page.WORST]]
    for w, t in zip(data["worst"], worst, strict=False):
        assert w["log_ratio"] == pytest.approx(t[4], abs=1e-5)
        assert w["rollout_url"].endswith(f"/steps/{t[0]}/groups/{t[1]}#r{t[2]}")
    counts = [b["tokens"] for b in data["by_probability"]]
    edges = mismatch_drill.PROBABILITY_EDGES
    for k, count in enumerate(counts):
        last = k == len(counts) - 1
        inside = [
            t
            for t in tokens
            if edges[k] <= math.exp(t[5]) and (last or math.exp(t[5]) < edges[k + 1])
        ]
        assert count == len(inside), k
    scatter = data["scatter"]
    assert scatter["tokens"] == len(tokens) and scatter["points"] == len(scatter["trainer"])
    points = set(zip(scatter["generator"], scatter["trainer"], strict=True))
    for t in worst[: mismatch_page.WORST]:  # the worst tokens are always among the points
        assert (round(t[5], 5), round(t[5] + t[4], 5)) in points


def test_a_step_and_a_range_equal_brute_force(
    session_factory: sessionmaker[Session], drilled: Any
) -> None:
    run_id, rows = drilled
    with client_for(session_factory) as client:
        one = client.get(f"/api/runs/{run_id}/mismatch?step=3").json()
        assert one["steps"]["read"] == [3] and one["generator_side"] is True
        _check_against(one, _brute(rows, {3}))
        several = client.get(f"/api/runs/{run_id}/mismatch?from=2&to=4").json()
        assert several["steps"]["read"] == [2, 3, 4] and not several["steps"]["cut"]
        _check_against(several, _brute(rows, {2, 3, 4}))
        last = client.get(f"/api/runs/{run_id}/mismatch").json()  # none given: the last step
        assert last["steps"]["read"] == [5]
        page = client.get(f"/runs/{run_id}/mismatch?from=2&to=4")
    assert page.status_code == 200
    html = parse(page.text)
    assert html.by_id("tokens-compared").text == f"{several['tokens']:,}"
    links = [a.attrs["href"] for a in html.find_all("a", cls="rollout-link")]
    assert links == [w["rollout_url"] for w in several["worst"]]
    figures = list(figures_in(html.json("page-data")))
    assert [f["id"] for f in figures] == ["mismatch-histogram", "mismatch-scatter"]
    for fig in figures:
        validate(fig)


def test_a_range_past_its_bounds_is_cut_and_says_where(
    session_factory: sessionmaker[Session], drilled: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range stops before the step that would pass MAX_TOKENS (the first step is read whole
    whatever its size) or after MAX_STEPS steps; the page says so and links the rest."""
    run_id, rows = drilled
    first_tokens = sum(len(r["trainer"]) for r in rows if r["step"] == 1 and r["abs_diff_max"])
    monkeypatch.setattr(mismatch_page, "MAX_TOKENS", first_tokens + 1)
    with client_for(session_factory) as client:
        cut = client.get(f"/api/runs/{run_id}/mismatch?from=1&to=5").json()
        assert cut["steps"]["read"] == [1] and cut["steps"]["cut"]
        assert cut["steps"]["next_from"] == 2
        _check_against(cut, _brute(rows, {1}))
        rest = client.get(cut["links"]["next"]).json()
        assert rest["asked"] == {"from": 2, "to": 5} and rest["steps"]["read"][0] == 2
        page = parse(client.get(f"/runs/{run_id}/mismatch?from=1&to=5").text)
        assert "The range is cut" in page.by_id("range-cut").text
        assert page.by_id("next-range").attrs["href"].endswith("/mismatch?from=2&to=5")
        monkeypatch.setattr(mismatch_page, "MAX_TOKENS", 10**9)
        monkeypatch.setattr(mismatch_page, "MAX_STEPS", 2)
        by_steps = client.get(f"/api/runs/{run_id}/mismatch?from=2").json()
    assert by_steps["steps"]["read"] == [2, 3] and by_steps["steps"]["next_from"] == 4


def test_a_run_without_a_generator_side_says_so(session_factory: sessionmaker[Session]) -> None:
    plain = make_run(session_factory, steps=3)
    with client_for(session_factory) as client:
        data = client.get(f"/api/runs/{plain}/mismatch?step=2").json()
        page = client.get(f"/runs/{plain}/mismatch?step=2")
        step = parse(client.get(f"/runs/{plain}/steps/2").text)
    assert data["generator_side"] is False and data["tokens"] == 0 and data["worst"] == []
    assert page.status_code == 200
    html = parse(page.text)
    assert "recorded no generator logprobs" in html.by_id("no-generator-side").text
    assert not html.find_all(id="fig-mismatch-histogram")
    assert not step.find_all(id="step-mismatch")  # the step page links no drill-down


@pytest.mark.parametrize(
    ("query", "status", "says"),
    [
        ("step=99", 404, "has no step 99; the nearest recorded step is 5"),
        ("from=4&to=2", 400, "from: 4 is after to (2)"),
        ("step=2&from=1", 400, "give a step, or a range"),
        ("from=90&to=95", 404, "recorded no step from 90 to 95"),
        ("step=-1", 422, "step"),
        ("step=two", 422, "step"),
        ("to=2147483648", 422, "to"),
    ],
)
def test_bad_parameters_get_a_clear_4xx(
    session_factory: sessionmaker[Session], drilled: Any, query: str, status: int, says: str
) -> None:
    run_id, _ = drilled
    with client_for(session_factory) as client:
        api = client.get(f"/api/runs/{run_id}/mismatch?{query}")
        page = client.get(f"/runs/{run_id}/mismatch?{query}")
        missing = client.get("/api/runs/9999/mismatch")
    assert api.status_code == status and says in api.text
    assert page.status_code == status and says in page.text.replace("&#39;", "'")
    assert missing.status_code == 404


def test_hostile_token_text_is_escaped(
    session_factory: sessionmaker[Session], drilled: Any
) -> None:
    run_id, _ = drilled
    with client_for(session_factory) as client:
        data = client.get(f"/api/runs/{run_id}/mismatch?from=1&to=5").json()
        page = client.get(f"/runs/{run_id}/mismatch?from=1&to=5").text
    assert HOSTILE in [w["token"] for w in data["worst"]]  # far off: among the worst
    assert HOSTILE not in page and "&lt;script&gt;alert(" in page
    scripts = parse(page).find_all("script")
    assert all(s.attrs.get("src") or s.attrs.get("type") == "application/json" for s in scripts)


def test_the_step_page_and_a_mismatch_alert_link_the_drill_down(
    session_factory: sessionmaker[Session], drilled: Any
) -> None:
    run_id, _ = drilled
    with client_for(session_factory) as client:
        step = parse(client.get(f"/runs/{run_id}/steps/2").text)
        assert step.by_id("step-mismatch").attrs["href"] == f"/runs/{run_id}/mismatch?step=2"
        alerts = [
            a for a in client.get(f"/api/runs/{run_id}/alerts").json() if a["kind"] == "mismatch"
        ]
        assert alerts, "the drift of the later steps passes the k3 threshold"
        for alert in alerts:
            assert alert["mismatch_url"] == f"/runs/{run_id}/mismatch?step={alert['step']}"
            assert "sort=abs_diff_max" in alert["rollouts_url"]
            assert client.get(alert["mismatch_url"]).status_code == 200
        run_page = parse(client.get(f"/runs/{run_id}").text)
    hrefs = {a.attrs["href"] for a in run_page.find_all("a", cls="alert-mismatch")}
    assert hrefs == {a["mismatch_url"] for a in alerts}
    with session_scope(session_factory) as session:
        row = session.scalars(select(AlertRow).where(AlertRow.kind == "mismatch")).first()
        run = session.get(RunRow, run_id)
        assert row is not None and run is not None
        body = alert_hooks.payload(row, run, "http://lens.example/")
    assert body["mismatch_url"] == f"http://lens.example/runs/{run_id}/mismatch?step={row.step}"
    assert f"<{body['mismatch_url']}|the tokens>" in body["text"]
