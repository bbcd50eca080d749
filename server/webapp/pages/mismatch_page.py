"""What the mismatch drill-down shows, from what queries.mismatch_page reads (pure: data and a
`url(name, **params)` in, the JSON twin's data and the page's context out): the histogram of
token log-ratios with the TIS/MIS bands, the scatter of generator vs trainer probability, the
table by the generator's probability and the worst tokens, each linked to its rollout.

Token texts stay plain strings here (the template escapes them); the figures carry numbers
only, no model text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlencode

from rollout_lens.server.core import mismatch
from rollout_lens.server.core.display import fmt_num

Url = Callable[..., str]  # route name and path params → path

INSIDE, BETWEEN, BEYOND = "#2563eb", "#f59e0b", "#dc2626"  # inside ×2, ×2 to ×5, beyond ×5
POINT, WORST = "rgba(37, 99, 235, 0.45)", "#dc2626"
P_FLOOR = 1e-7  # the scatter's axes start here (the store floors logprobs at −15: p = 3e-7)
FIGURE_NAMES = (  # (series, label) of the figures card, in the run page's words
    (mismatch.K3_KL, "k3 KL(gen ‖ trainer)"),
    (mismatch.ABS_DIFF_MEAN, "mean |Δlogp|"),
    (mismatch.ABS_DIFF_MAX, "max |Δlogp|"),
    (mismatch.OUTSIDE_2X, "outside ×2"),
    (mismatch.OUTSIDE_5X, "outside ×5"),
    (mismatch.SEQ_RATIO_MIN, "seq. ratio min"),
    (mismatch.SEQ_RATIO_MEAN, "seq. ratio mean"),
    (mismatch.SEQ_RATIO_MAX, "seq. ratio max"),
)


def seq_ratio_text(log_ratio: float | None) -> str:
    """A ratio from its log, for a cell (a rollout's sequence ratio, a token's r): 3 significant
    digits, e^x past float range."""
    if log_ratio is None or not math.isfinite(log_ratio):
        return "—"
    if abs(log_ratio) > 700:
        return f"e^{log_ratio:.4g}"
    return f"{math.exp(log_ratio):.3g}"


def _path(path: str, params: dict[str, Any]) -> str:
    kept = {k: v for k, v in params.items() if v is not None}
    return f"{path}?{urlencode(kept)}" if kept else path


def mismatch_json(data: dict[str, Any], url: Url) -> dict[str, Any]:
    """The JSON twin: the query's data with each worst token's links (its step and rollout in
    the step viewer) and the next range's page when the range was cut."""
    run_id = data["run"]["id"]
    for w in data["worst"]:
        group_url = url("group_page", run_id=run_id, step=w["step"], group=w["group"])
        w["step_url"] = url("step_page", run_id=run_id, step=w["step"])
        w["rollout_url"] = f"{group_url}#r{w['index']}"
    steps, asked = data["steps"], data["asked"]
    last = asked.get("to")
    nxt = None
    if steps["cut"] and steps["next_from"] is not None:
        nxt = {"from": steps["next_from"], "to": last}
    data["links"] = {
        "next": None if nxt is None else _path(url("api_mismatch", run_id=run_id), nxt),
        "page": _path(url("mismatch_page", run_id=run_id), _asked(asked)),
    }
    return data


def _asked(asked: dict[str, Any]) -> dict[str, Any]:
    return (
        {"step": asked["step"]} if "step" in asked else {"from": asked["from"], "to": asked["to"]}
    )


def mismatch_page(data: dict[str, Any], url: Url) -> dict[str, Any]:
    """The drill-down page: the JSON twin's data plus its figures, tables and links."""
    data = mismatch_json(data, url)
    run_id = data["run"]["id"]
    path = url("mismatch_page", run_id=run_id)
    steps = data["steps"]
    figures = []
    if data["tokens"]:
        figures = [histogram(data["histogram"]), scatter(data["scatter"])]
    nxt = data["links"]["next"]
    return {
        "d": data,
        "run_url": url("run_page", run_id=run_id),
        "explorer_url": url("explorer_page", run_id=run_id),
        "path": path,
        "json_url": _path(url("api_mismatch", run_id=run_id), _asked(data["asked"])),
        "next_range_url": None if nxt is None else path + nxt[nxt.index("?") :],
        "read_text": _steps_text(steps["read"]),
        "facts": [
            (label, _figure_text(name, data["figures"].get(name))) for name, label in FIGURE_NAMES
        ],
        "buckets": [_bucket_row(b) for b in data["by_probability"]],
        "worst_rows": [_worst_row(w) for w in data["worst"]],
        "step_urls": {s: url("step_page", run_id=run_id, step=s) for s in steps["unkept"]},
        "figures": figures,
        "page": {"figures": figures, "steps": url("step_jump", run_id=run_id)},
    }


def _worst_row(w: dict[str, Any]) -> dict[str, Any]:
    """A worst token's row: its ratio and both probabilities as text, the context around it on
    one line (line breaks and tabs shown as the token view shows them)."""
    return w | {
        "before": _one_line(w["before"]),
        "after": _one_line(w["after"]),
        "ratio": seq_ratio_text(w["log_ratio"]),
        "p_generator": f"{math.exp(w['generator_logprob']):.3g}",
        "p_trainer": f"{math.exp(w['trainer_logprob']):.3g}",
    }


def _one_line(text: str | None) -> str | None:
    return None if text is None else text.replace("\n", "↵").replace("\t", "⇥")


def _steps_text(read: Sequence[int]) -> str:
    """The steps read, in words: "12", "3–7" or "3, 5–9" (runs of consecutive steps joined)."""
    runs: list[list[int]] = []
    for s in read:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs)


def _figure_text(name: str, value: float | None) -> str:
    if value is None:
        return "—"
    if name in (mismatch.OUTSIDE_2X, mismatch.OUTSIDE_5X):
        return f"{value * 100:.3g}%"
    return f"{value:.4g}"


def _probability(p: float) -> str:
    return f"{p:g}"


def _bucket_row(b: dict[str, Any]) -> dict[str, Any]:
    """A row of the table by generator probability, its numbers as text."""
    last = b["high"] == 1.0
    return {
        "range": f"{_probability(b['low'])} ≤ p {'≤' if last else '<'} {_probability(b['high'])}",
        "tokens": f"{b['tokens']:,}",
        "abs_diff_mean": fmt_num(b["abs_diff_mean"], 4),
        "abs_diff_max": fmt_num(b["abs_diff_max"], 3),
        "k3_kl": "—" if b["k3_kl"] is None else f"{b['k3_kl']:.3g}",
        "outside_2x": "—" if b["outside_2x"] is None else f"{b['outside_2x'] * 100:.3g}%",
        "outside_5x": "—" if b["outside_5x"] is None else f"{b['outside_5x'] * 100:.3g}%",
    }


# --- figures -------------------------------------------------------------------------------------


def _zone(left: float, right: float) -> str:
    """A bin's colour: inside the ×2 band, between ×2 and ×5, or beyond ×5."""
    middle = abs((left + right) / 2)
    if middle < math.log(mismatch.BANDS[0]):
        return INSIDE
    return BETWEEN if middle < math.log(mismatch.BANDS[1]) else BEYOND


def histogram(hist: dict[str, Any]) -> dict[str, Any]:
    """Token log-ratios binned, counts on a log axis (an empty bin draws nothing), the bands'
    edges drawn as dashed lines and each bin coloured by the band it lies in."""
    edges, counts = hist["edges"], hist["counts"]
    pairs = list(zip(edges[:-1], edges[1:], strict=True))
    trace = {
        "type": "bar",
        "x": [(a + b) / 2 for a, b in pairs],
        "y": [c if c else None for c in counts],
        "width": [b - a for a, b in pairs],
        "marker": {"color": [_zone(a, b) for a, b in pairs], "line": {"width": 0}},
        "customdata": [
            [round(a, 3), round(b, 3), f"{math.exp(a):.3g}", f"{math.exp(b):.3g}"] for a, b in pairs
        ],
        "hovertemplate": "log r %{customdata[0]} to %{customdata[1]} "
        "(ratio %{customdata[2]}–%{customdata[3]})<br>%{y:,} tokens<extra></extra>",
        "name": "tokens",
    }
    shapes, notes = [], []
    for edge in hist["bands"]:
        shapes.append(
            {
                "type": "line",
                "x0": edge,
                "x1": edge,
                "y0": 0,
                "y1": 1,
                "yref": "paper",
                "line": {"color": "#475569", "width": 1, "dash": "dash"},
            }
        )
        ratio = math.exp(edge)
        label = f"×{ratio:.3g}" if ratio > 1 else f"×1/{1 / ratio:.3g}"
        notes.append(_note(edge, 1.0, label))
    limit = edges[-1]
    if hist["below"]:
        notes.append(_note(edges[0], 0.9, f"{hist['below']:,} below −{limit:g}", "left"))
    if hist["above"]:
        notes.append(_note(limit, 0.9, f"{hist['above']:,} above {limit:g}", "right"))
    return {
        "id": "mismatch-histogram",
        "data": [trace],
        "layout": {
            "height": 320,
            "margin": {"l": 60, "r": 20, "t": 24, "b": 50},
            "bargap": 0,
            "xaxis": {
                "title": {"text": "log r = log p_trainer − log p_generator"},
                "range": [edges[0], limit],
                "zeroline": False,
            },
            "yaxis": {"type": "log", "title": {"text": "tokens (log scale)"}},
            "shapes": shapes,
            "annotations": notes,
            "showlegend": False,
        },
    }


def _note(x: float, y: float, label: str, anchor: str = "center") -> dict[str, Any]:
    return {
        "x": x,
        "y": y,
        "yref": "paper",
        "text": label,
        "showarrow": False,
        "xanchor": anchor,
        "yanchor": "bottom",
        "font": {"size": 11, "color": "#475569"},
    }


def _band_line(factor: float, dash: str, color: str, name: str) -> dict[str, Any]:
    """p_trainer = factor × p_generator across the axes (cut at p = 1)."""
    x = [P_FLOOR, min(1.0, 1.0 / factor)]
    return {
        "type": "scatter",
        "mode": "lines",
        "x": x,
        "y": [v * factor for v in x],
        "line": {"color": color, "width": 1, "dash": dash},
        "hoverinfo": "skip",
        "name": name,
        "legendgroup": name,
        "showlegend": factor >= 1,
    }


def scatter(points: dict[str, Any]) -> dict[str, Any]:
    """Generator vs trainer probability of the sampled tokens (both axes log: mismatch lives at
    low probabilities), the diagonal and the ×2 and ×5 bands drawn, the worst tokens in red; a
    point's customdata is its rollout's (step, group, index): a click opens it."""
    gen = [math.exp(v) for v in points["generator"]]
    trainer = [math.exp(v) for v in points["trainer"]]
    worst = set(points["worst"])
    hover = (
        "generator p %{x:.3g} · trainer p %{y:.3g}<br>step %{customdata[0]} · group "
        "%{customdata[1]} · #%{customdata[2]}<extra></extra>"
    )
    traces: list[dict[str, Any]] = [
        _band_line(1.0, "solid", "#94a3b8", "p_trainer = p_generator"),
        *(_band_line(f, "dash", BETWEEN, "×2 band") for f in (2.0, 0.5)),
        *(_band_line(f, "dot", BEYOND, "×5 band") for f in (5.0, 0.2)),
    ]
    for name, keep, marker in (
        ("tokens", False, {"size": 4, "color": POINT}),
        ("worst tokens", True, {"size": 8, "color": WORST, "symbol": "diamond"}),
    ):
        chosen = [i for i in range(len(gen)) if (i in worst) == keep]
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": name,
                "x": [gen[i] for i in chosen],
                "y": [trainer[i] for i in chosen],
                "customdata": [points["rollouts"][i] for i in chosen],
                "marker": marker,
                "hovertemplate": hover,
            }
        )
    axis = {"type": "log", "range": [math.log10(P_FLOOR), 0.05], "exponentformat": "power"}
    return {
        "id": "mismatch-scatter",
        "data": traces,
        "layout": {
            "height": 460,
            "margin": {"l": 70, "r": 20, "t": 10, "b": 50},
            "xaxis": axis | {"title": {"text": "generator probability of the sampled token"}},
            "yaxis": axis | {"title": {"text": "trainer probability"}},
            "legend": {"orientation": "h", "y": -0.18},
            "hovermode": "closest",
        },
    }
