"""Every figure the server sends is valid Plotly: checked against plotly.py's schema.

The figures are hand-built JSON at serve time (plotly.py is too slow to build them per request);
plotly.graph_objects.Figure validates each property on construction, so a misspelt or misplaced
property fails here instead of being silently ignored by Plotly.js in the browser.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import plotly.graph_objects as go
import pytest
from fastapi.testclient import TestClient
from rollout_lens.server.core import mismatch, vocab
from rollout_lens.server.webapp.pages import plotly_figures
from sqlalchemy.orm import Session, sessionmaker

from tests.factories import CONTROL_TOKENS, make_run
from tests.web_support import parse, record_collapse_run


def validate(fig: dict[str, Any]) -> go.Figure:
    """The figure as plotly.py reads it; ValueError on any property its schema lacks."""
    return go.Figure({"data": fig["data"], "layout": fig["layout"]})


def figures_in(value: Any) -> Iterator[dict[str, Any]]:
    """Every figure ({data, layout}) anywhere in a page's JSON."""
    if isinstance(value, dict):
        if "data" in value and "layout" in value:
            yield value
        for inner in value.values():
            yield from figures_in(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from figures_in(inner)


def page_figures(client: TestClient, url: str) -> list[dict[str, Any]]:
    response = client.get(url)
    assert response.status_code == 200, response.text
    data = json.loads(parse(response.text).by_id("page-data").text)
    return list(figures_in(data))


def every_series() -> list[str]:
    names = list(vocab.STEP_SERIES)
    names += [vocab.ctrl(t, s) for t in CONTROL_TOKENS for s in vocab.CTRL_STATS]
    names += [vocab.state(s) for s in vocab.STATES]
    names += [
        vocab.probe(p, part)
        for p in (*vocab.POSITIONAL_PROBES, *vocab.ID_PROBES)
        for part in (*vocab.PROBE_STATS, *(f"{s}/mean" for s in vocab.PROBE_SPLITS))
    ]
    names += [vocab.FORMAT_FREE_ACCURACY, *vocab.TOOL_SERIES]
    names += [vocab.turn_state(p, s) for p in vocab.TURN_POSITIONS for s in vocab.TURN_STATES]
    names += list(mismatch.NAMES)
    return names + [*vocab.EVAL_SERIES, vocab.SFT_LOSS, vocab.trl("clip_ratio")]


def test_a_misspelt_property_is_rejected() -> None:
    good = plotly_figures.figure(
        "f", "title", plotly_figures.line("reward_mean", "reward", "#2563eb")
    )
    validate(good)
    bad_trace = json.loads(json.dumps(good))
    bad_trace["data"][2]["hovertemplat"] = "%{y}"
    with pytest.raises(ValueError, match="hovertemplat"):
        validate(bad_trace)
    bad_layout = json.loads(json.dumps(good))
    bad_layout["layout"]["yaxis"]["autorangeoption"] = {"include": [0, 1]}
    with pytest.raises(ValueError, match="autorangeoption"):
        validate(bad_layout)
    bad_value = json.loads(json.dumps(good))
    bad_value["data"][2]["line"]["dash"] = "dotted"
    with pytest.raises(ValueError, match="dash"):
        validate(bad_value)


def test_every_run_figure_is_valid() -> None:
    built = plotly_figures.run_figures(list(CONTROL_TOKENS), every_series())
    found = list(figures_in(built))
    assert len(found) > 20
    for fig in found:
        validate(fig)


def test_every_compare_figure_is_valid_with_data() -> None:
    runs = [{"id": i, "name": f"run {i}", "control_tokens": list(CONTROL_TOKENS)} for i in (1, 2)]
    points = {"x": [1, 2, 3], "y": [0.1, 0.5, None], "lo": [0.0, 0.4, None], "hi": [0.2, 0.6, None]}
    series = {str(r["id"]): {"series": dict.fromkeys(every_series(), points)} for r in runs}
    built = plotly_figures.compare_figures(runs, series, vocab.COMPARE_SERIES)
    found = list(figures_in(built))
    assert len(found) >= len(vocab.COMPARE_SERIES) + len(vocab.COMPARE_EXTRA)
    for fig in found:
        validate(fig)


def test_every_figure_the_pages_send_is_valid(
    session_factory: sessionmaker[Session], client: TestClient
) -> None:
    collapse = record_collapse_run(session_factory)
    plain = make_run(session_factory, steps=4)
    sent = page_figures(client, f"/runs/{collapse}")
    sent += page_figures(client, f"/runs/{plain}")
    sent += page_figures(client, f"/compare?runs={collapse},{plain}")
    assert len(sent) > 20
    for fig in sent:
        validate(fig)
