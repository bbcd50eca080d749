"""Plotly figure JSON for the prompt lens (pure: data in, figures out): the prompts × steps
heatmap and a prompt's reward and true score over its steps.

Prompt text is untrusted and Plotly reads a subset of HTML in labels and hover text, so every
text that reaches a figure goes through plotly_text (tags become entities).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from rollout_lens.server.webapp.pages.plotly_figures import COLORS, plotly_text

LABEL_CHARS = 48  # a heatmap row's label: the head of what tells its prompt apart
ROW_PX, MIN_ROW_PX = 20, 3  # a heatmap row's height: as tall as fits, never under 3 px
LABELLED_ROW_PX = 12  # below this a row's label would overlap the next: hover names it instead
MIN_HEIGHT, MAX_HEIGHT = 220, 1400
AXES_PX = 90  # the x axis and its title under the rows
# failed (red) → split (amber) → solved (green): a cell's true score (or reward)
SCALE = [[0.0, "#dc2626"], [0.5, "#f5c542"], [1.0, "#16a34a"]]


def row_label(prompt_id: int, text: str) -> str:
    """A heatmap row's label: the prompt's id and the head of its distinguishing text (unique by
    the id, so two prompts with the same head stay two rows)."""
    head = " ".join(text.split())
    head = head if len(head) <= LABEL_CHARS else head[: LABEL_CHARS - 1] + "…"
    return plotly_text(f"#{prompt_id} {head}")


def row_height(rows: int) -> int:
    """A heatmap row's height in pixels: ROW_PX while the rows fit MAX_HEIGHT, then less (a page
    of 500 prompts stays one screen tall), never under MIN_ROW_PX."""
    if rows <= 0:
        return ROW_PX
    return max(MIN_ROW_PX, min(ROW_PX, (MAX_HEIGHT - AXES_PX) // rows))


def _short(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def _scale_title(by_true: int, by_reward: int) -> str:
    """The colour bar's title: what its cells are coloured by."""
    if by_reward and not by_true:
        return "reward"
    return "true score<br>(else reward)" if by_reward else "true score"


class _Cells(NamedTuple):
    """The heatmap's cells: their colour values, hover data, and what coloured them."""

    z: list[list[float | None]]
    custom: list[list[Any]]
    values: list[float]  # every value shown: the colour scale spans them
    by_true: int  # cells coloured by a true score
    by_reward: int  # cells coloured by a reward (none of their rollouts had a true score)


def heatmap(rows: Sequence[dict[str, Any]], buckets: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Prompts × step buckets, one row a prompt in the order given (top first).

    `rows`: {"prompt_id", "label", "cells"}; `cells` aligned with `buckets` ((first, last) step
    of each column), each None (no group of the prompt there) or {"groups", "true_mean",
    "reward_mean", "step", "group"} where (step, group) is the group a click opens. A cell is
    coloured by its true score, by its reward where no rollout of it has one."""
    cells = _cells(rows, buckets)
    row_px = row_height(len(rows))
    trace = {
        "type": "heatmap",
        "x": [(lo + hi) / 2 for lo, hi in buckets],
        "y": [row_label(r["prompt_id"], r["label"]) for r in rows],
        "z": cells.z,
        "customdata": cells.custom,
        "zmin": min([0.0, *cells.values]),
        "zmax": max([1.0, *cells.values]),
        "colorscale": SCALE,
        "xgap": 1 if len(buckets) <= 200 else 0,
        "ygap": 1 if row_px >= 6 else 0,
        "hoverongaps": False,
        "colorbar": {
            "title": {"text": _scale_title(cells.by_true, cells.by_reward)},
            "thickness": 12,
            "len": 0.9,
        },
        "hovertemplate": (
            "%{y}<br>step %{customdata[3]} · %{customdata[2]} group(s)<br>"
            "true score %{customdata[4]} · reward %{customdata[5]}<br>"
            "click: step %{customdata[0]}, group %{customdata[1]}<extra></extra>"
        ),
    }
    return {
        "id": "prompt-heatmap",
        "data": [trace],
        "layout": _heatmap_layout(len(rows), buckets, row_px),
    }


def _cells(rows: Sequence[dict[str, Any]], buckets: Sequence[tuple[int, int]]) -> _Cells:
    """Each row's cells: a colour value (its true score, else its reward) and its hover data
    (the group a click opens, its groups, steps and scores)."""
    z: list[list[float | None]] = []
    custom: list[list[Any]] = []
    values: list[float] = []
    by_true = by_reward = 0
    for r in rows:
        line: list[float | None] = []
        data: list[Any] = []
        for (lo, hi), cell in zip(buckets, r["cells"], strict=True):
            if cell is None:
                line.append(None)
                data.append(None)
                continue
            true, reward = cell["true_mean"], cell["reward_mean"]
            value = true if true is not None else reward
            by_true += true is not None
            by_reward += true is None and reward is not None
            line.append(value)
            if value is not None:
                values.append(value)
            steps = str(lo) if lo == hi else f"{lo}–{hi}"
            data.append(
                [cell["step"], cell["group"], cell["groups"], steps, _short(true), _short(reward)]
            )
        z.append(line)
        custom.append(data)
    return _Cells(z, custom, values, by_true, by_reward)


def _heatmap_layout(rows: int, buckets: Sequence[tuple[int, int]], row_px: int) -> dict[str, Any]:
    """Rows labelled where tall enough to read (else hovered), the x axis naming the buckets'
    width where all are as wide."""
    widths = {hi - lo + 1 for lo, hi in buckets}
    width = widths.pop() if len(widths) == 1 else None
    labelled = row_px >= LABELLED_ROW_PX
    return {
        "height": max(MIN_HEIGHT, row_px * rows + AXES_PX),
        "margin": {"l": 330 if labelled else 40, "r": 20, "t": 10, "b": 40},
        "xaxis": {
            "title": {"text": "step" if width == 1 else f"step ({width}-step buckets)"},
            "zeroline": False,
            "showgrid": False,
        },
        "yaxis": {
            "type": "category",
            "autorange": "reversed",
            "automargin": False,
            "showticklabels": labelled,
            "ticks": "",
            "title": {"text": "" if labelled else f"{rows} prompts (hover a row for its text)"},
            "tickfont": {"size": 11},
            "showgrid": False,
        },
        "plot_bgcolor": "#f1f5f9",
        "hoverlabel": {"align": "left"},
    }


def history(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A prompt's groups over its steps: mean reward and true score of each group."""
    x = [s["step"] for s in steps]
    traces = []
    # true score first, reward dashed over it: where the verifier is exact the two coincide and
    # both stay visible
    for key, name, color, dash, mode in (
        ("true_mean", "true score", COLORS["true_accuracy"], "solid", "lines+markers"),
        ("reward_mean", "reward", COLORS["reward_mean"], "dash", "lines"),
    ):
        traces.append(
            {
                "type": "scatter",
                "mode": mode,
                "x": x,
                "y": [s.get(key) for s in steps],
                "name": name,
                "line": {"color": color, "width": 1.7, "dash": dash},
                "marker": {"size": 6, "color": color},
                "customdata": [s["group"] for s in steps],
                "hovertemplate": f"step %{{x}} · group %{{customdata}}<br>{name} %{{y:.3g}}"
                "<extra></extra>",
            }
        )
    return {
        "id": "prompt-history",
        "data": traces,
        "layout": {
            "height": 280,
            "margin": {"l": 50, "r": 20, "t": 10, "b": 40},
            "xaxis": {"title": {"text": "step"}, "zeroline": False},
            "yaxis": {"rangemode": "tozero", "autorangeoptions": {"include": [0, 1]}},
            "legend": {"orientation": "h", "y": 1.12},
            "hovermode": "closest",
        },
    }
