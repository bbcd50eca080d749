"""The prompt lens's figure builders (pure): the prompts × steps heatmap stays readable from the
seed's 9 prompts × 150 steps to a page of 500 prompts × 1,000 steps in 5-step buckets."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
import pytest
from rollout_lens.server.webapp.pages import prompt_figures, prompt_pages
from rollout_lens.server.webapp.pages.prompt_pages import buckets


def _heat(prompts: int, steps: int, width: int) -> dict[str, Any]:
    """queries.heatmap's shape for `prompts` rows over steps 1…steps at `width` columns, a group
    of each prompt in every step (its true score alternating by bucket)."""
    bucket = max(1, -(-steps // width))
    columns = -(-steps // bucket)
    return {
        "first_step": 1,
        "last_step": steps,
        "bucket": bucket,
        "columns": columns,
        "rows": [
            {
                "prompt_id": p,
                "label": f"query {p}",
                "cells": [
                    {
                        "col": c,
                        "groups": bucket,
                        "true_mean": float((c + p) % 2),
                        "reward_mean": 0.5,
                        "step": 1 + c * bucket,
                        "group": p,
                    }
                    for c in range(columns)
                ],
            }
            for p in range(1, prompts + 1)
        ],
    }


def _figure(prompts: int, steps: int, width: int = 200) -> dict[str, Any]:
    heat = _heat(prompts, steps, width)
    columns = buckets(heat)
    rows = [
        {"prompt_id": r["prompt_id"], "label": r["label"], "cells": list(r["cells"])}
        for r in heat["rows"]
    ]
    figure = prompt_figures.heatmap(rows, columns)
    go.Figure({"data": figure["data"], "layout": figure["layout"]})  # valid Plotly, or raises
    return figure


@pytest.mark.parametrize(
    ("prompts", "steps", "columns", "labelled"),
    [(9, 150, 150, True), (50, 1_000, 200, True), (500, 1_000, 200, False)],
)
def test_the_heatmap_fits_a_screen_at_every_shape(
    prompts: int, steps: int, columns: int, labelled: bool
) -> None:
    figure = _figure(prompts, steps)
    (trace,) = figure["data"]
    assert len(trace["y"]) == prompts and len(trace["x"]) == columns
    assert all(len(line) == columns for line in trace["z"])
    layout = figure["layout"]
    row_px = prompt_figures.row_height(prompts)
    assert prompt_figures.MIN_ROW_PX <= row_px <= prompt_figures.ROW_PX
    assert layout["height"] == max(prompt_figures.MIN_HEIGHT, row_px * prompts + 90)
    assert layout["height"] <= max(prompt_figures.MAX_HEIGHT, prompt_figures.MIN_ROW_PX * 500 + 90)
    # labels while a row is tall enough for one; past that the hover names the row
    assert layout["yaxis"]["showticklabels"] is labelled
    assert (row_px >= prompt_figures.LABELLED_ROW_PX) is labelled
    title = layout["xaxis"]["title"]["text"]
    assert title == ("step" if steps <= 200 else f"step ({-(-steps // 200)}-step buckets)")


def test_a_cell_names_the_group_a_click_opens_and_its_numbers() -> None:
    figure = _figure(3, 1_000)
    (trace,) = figure["data"]
    step, group, groups, span, true, reward = trace["customdata"][1][7]
    assert (step, group, groups, span) == (1 + 7 * 5, 2, 5, "36–40")
    assert (true, reward) == ("1", "0.5")  # prompt 2, column 7: (7 + 2) % 2
    assert trace["z"][1][7] == 1.0
    assert trace["x"][7] == 38  # the bucket's middle step


def test_a_label_is_text_to_plotly() -> None:
    label = prompt_figures.row_label(3, "<b>bold</b> <script>x</script> " + "w" * 80)
    assert "<" not in label and label.startswith("#3 &lt;b&gt;bold")
    assert label.endswith("…")


def test_a_history_lists_its_top_votes_and_counts_the_rest() -> None:
    votes = {f"tool_{i:02d}": 40 - i for i in range(30)} | {"None": 3}
    shown = prompt_pages.top_votes(votes, top=10)
    assert list(shown["top"]) == [f"tool_{i:02d}" for i in range(10)]
    assert shown["others"] == 21
    assert shown["others_count"] == sum(40 - i for i in range(10, 30)) + 3
    assert prompt_pages.top_votes({"tool_01": 8})["others"] == 0


@pytest.mark.parametrize(
    ("true_scores", "title"),
    [
        ([1.0, 0.0], "true score"),
        ([None, None], "reward"),
        ([1.0, None], "true score<br>(else reward)"),
    ],
)
def test_the_colour_bar_says_what_colours_the_cells(
    true_scores: list[float | None], title: str
) -> None:
    """A run with no true score is coloured by its rewards, and the colour bar says so."""
    cells = [
        {"groups": 1, "true_mean": t, "reward_mean": 0.5, "step": s, "group": 0}
        for s, t in enumerate(true_scores, start=1)
    ]
    rows = [{"prompt_id": 1, "label": "a query", "cells": cells}]
    figure = prompt_figures.heatmap(rows, [(1, 1), (2, 2)])
    assert figure["data"][0]["colorbar"]["title"]["text"] == title
