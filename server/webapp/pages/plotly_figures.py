"""Plotly figure JSON for the run and compare pages (pure: names and data in, figures out).

Every line trace comes as three traces — lo, hi (a translucent band between them) and the mean —
tagged with meta {"series", "part"} so the page's script can fill and extend them from the series
API without knowing which chart holds what. Undownsampled data has lo = hi = y: no band shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_lens.server.core import mismatch as mm
from rollout_lens.server.core import vocab
from rollout_lens.server.core.alerts import AlertThresholds
from rollout_lens.server.core.analysis import CONVERGED
from rollout_lens.server.core.vocab import STEP_SERIES, WINDOW, label

FREE = vocab.FORMAT_FREE_ACCURACY

COLORS = {
    "reward_mean": "#2563eb",
    "true_accuracy": "#ea580c",
    "vote_agreement": "#7c3aed",
    "vote_entropy": "#0d9488",
    "format_valid_rate": "#16a34a",
    "zero_std_share": "#64748b",
}
GROUP_SPREAD = (  # the zero-std groups split: (series, legend, color)
    (vocab.SOLVED_GROUPS, "solved groups", "#059669"),
    (vocab.STUCK_GROUPS, "stuck groups", "#b91c1c"),
)
TOKEN_COLORS = ("#db2777", "#0891b2", "#9333ea", "#ca8a04", "#4f46e5", "#059669")
RUN_COLORS = (
    "#2563eb",
    "#ea580c",
    "#16a34a",
    "#9333ea",
    "#db2777",
    "#0891b2",
    "#ca8a04",
    "#475569",
)
NEUTRAL = "#334155"

UNIT_RANGE = {
    "autorangeoptions": {"include": [0, 1]},
    "rangemode": "tozero",
}  # shares: never below 0


def plotly_text(text: str) -> str:
    """Text for a Plotly label: Plotly reads a subset of HTML there, so tags must be entities."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _rgba(color: str, alpha: float) -> str:
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r}, {g}, {b}, {alpha})"


def line(
    series: str,
    name: str,
    color: str,
    *,
    data: dict[str, list[Any]] | None = None,
    dash: str = "solid",
    axis: str = "y",
    run_id: int | None = None,
) -> list[dict[str, Any]]:
    """A series as band (lo, hi) + mean traces, empty unless `data` is given."""
    x = list(data["x"]) if data else []
    y = list(data["y"]) if data else []
    meta = {"series": series} | ({"run": run_id} if run_id is not None else {})
    common = {
        "type": "scatter",
        "mode": "lines",
        "x": x,
        "yaxis": axis,
        "legendgroup": f"{run_id}:{series}",
    }
    band = {"line": {"width": 0, "color": color}, "hoverinfo": "skip", "showlegend": False}
    return [
        common
        | band
        | {"y": list(data.get("lo", y)) if data else [], "meta": meta | {"part": "lo"}},
        common
        | band
        | {
            "y": list(data.get("hi", y)) if data else [],
            "fill": "tonexty",
            "fillcolor": _rgba(color, 0.18),
            "meta": meta | {"part": "hi"},
        },
        common
        | {
            "y": y,
            "name": plotly_text(name),
            "line": {"color": color, "width": 1.7, "dash": dash},
            "hovertemplate": "%{y:.4~g}",
            "meta": meta | {"part": "y"},
        },
    ]


def _bucket_lines(series: str, color: str) -> list[dict[str, Any]]:
    """A bucket series as three traces the page fills (chart_data.bucket_geometry): a segment over
    each closed bucket's steps, a dotted one over the bucket still filling, and a marker at each
    centre (open while partial) that carries the hover."""
    common = {"type": "scatter", "x": [], "y": [], "legendgroup": series, "hoverinfo": "skip"}
    return [
        common
        | {
            "mode": "lines",
            "line": {"color": color, "width": 2.2},
            "showlegend": False,
            "meta": {"bucket": series, "part": "closed"},
        },
        common
        | {
            "mode": "lines",
            "line": {"color": color, "width": 2.2, "dash": "dot"},
            "showlegend": False,
            "meta": {"bucket": series, "part": "partial"},
        },
        {
            "type": "scatter",
            "mode": "markers",
            "x": [],
            "y": [],
            "legendgroup": series,
            "name": plotly_text(label(series)),
            "marker": {"size": 7, "color": color, "line": {"color": color, "width": 1.5}},
            "customdata": [],
            "hovertemplate": "%{customdata}: %{y:.3f}",
            "meta": {"bucket": series, "part": "center"},
        },
    ]


def layout(
    *, height: int = 240, y: dict[str, Any] | None = None, y2: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The house layout: compact margins, step x axis, unified hover, legend above."""
    grid = "#e9edf2"
    out: dict[str, Any] = {
        "height": height,
        "margin": {"l": 48, "r": 48 if y2 else 14, "t": 6, "b": 34},
        "hovermode": "x unified",
        "showlegend": True,
        "legend": {"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom", "font": {"size": 11}},
        "font": {
            "family": "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif",
            "size": 11,
            "color": NEUTRAL,
        },
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
        "xaxis": {"title": {"text": "step", "standoff": 4}, "gridcolor": grid, "zeroline": False},
        "yaxis": {"gridcolor": grid, "zeroline": False, "automargin": True} | (y or {}),
    }
    if y2:
        out["yaxis2"] = {
            "overlaying": "y",
            "side": "right",
            "showgrid": False,
            "zeroline": False,
            "tickmode": "auto",
        } | y2
    return out


def figure(
    fid: str,
    title: str,
    traces: list[dict[str, Any]],
    *,
    help: str = "",
    small: bool = False,
    wide: bool = False,
    alerts: Sequence[str] = (),
    empty: str = "",
    **layout_args: Any,
) -> dict[str, Any]:
    """One chart: its title and help for the card, Plotly data and layout, alert kinds it shows,
    and what its card says while it has no data (`empty`; default "no data recorded")."""
    spec = layout(height=180 if small else 250, **layout_args)
    if small:  # one series: the card's title names it
        spec["showlegend"] = False
        spec["margin"]["t"] = 4
    return {
        "id": fid,
        "title": title,
        "help": help,
        "small": small,
        "wide": wide,
        "alerts": list(alerts),
        "empty": empty,
        "data": traces,
        "layout": spec,
    }


def _control_traces(control_tokens: Sequence[str], names: set[str]) -> list[dict[str, Any]]:
    traces = []
    for i, token in enumerate(control_tokens):
        color = TOKEN_COLORS[i % len(TOKEN_COLORS)]
        for stat, dash in zip(vocab.CTRL_STATS[::-1], ("solid", "dot"), strict=True):
            if vocab.ctrl(token, stat) in names:
                traces += line(vocab.ctrl(token, stat), f"{token} {stat}", color, dash=dash)
    return traces


STATE_COLORS = {  # keyed by server.core.vocab.FormatState
    "healthy_call": "#16a34a",
    "text_pollution": "#ca8a04",
    "collapse": "#dc2626",
    "no_call": "#64748b",
}


def _state_trace(name: str, colors: dict[str, str] = STATE_COLORS) -> dict[str, Any]:
    """A stacked share (no band: shares of one step add up to 1), colored by its state."""
    state = name.rsplit("/", 1)[1]
    color = colors.get(state, NEUTRAL)
    return {
        "type": "scatter",
        "mode": "lines",
        "x": [],
        "y": [],
        "name": plotly_text(vocab.state_label(state)),
        "stackgroup": "state",
        "line": {"color": color, "width": 0.8},
        "fillcolor": _rgba(color, 0.55),
        "hovertemplate": "%{y:.2f}",
        "meta": {"series": name, "part": "y"},
    }


TURN_STATE_COLORS = {  # keyed by server.core.vocab.TurnState
    "healthy_call": "#16a34a",
    "text_pollution": "#ca8a04",
    "open_call": "#ea580c",
    "eot_in_call": "#dc2626",
    "no_call": "#64748b",
}


def tool_use(names: set[str]) -> list[dict[str, Any]]:
    """Charts of a tool-calling run: calls and turns per rollout, right-tool and failure rates,
    and the structural state of the model turns at each position (1, 2, 3+)."""
    out = []
    counts = [n for n in (vocab.TOOL_CALLS, vocab.TOOL_TURNS) if n in names]
    if counts:
        traces = []
        for n, color in zip(counts, (COLORS["true_accuracy"], NEUTRAL), strict=False):
            traces += line(n, vocab.TOOL_SERIES[n], color)
        out.append(
            figure(
                "tool-calls",
                "Calls and turns per rollout",
                traces,
                help="Mean per rollout and step: tool calls TRL parsed from the model's turns, "
                "and model turns (a turn after each tool result).",
                y={"rangemode": "tozero"},
            )
        )
    rates = [n for n in (vocab.RIGHT_TOOL_RATE, vocab.TOOL_FAILURE_RATE) if n in names]
    if rates:
        traces = []
        for n, color in zip(rates, ("#16a34a", "#dc2626"), strict=False):
            traces += line(n, vocab.TOOL_SERIES[n], color)
        out.append(
            figure(
                "tool-rates",
                "Right-tool rate · tool failure rate",
                traces,
                help="Share of calls to a tool the episode needs, and TRL's share of calls that "
                "failed (an error, or a tool the rollout was not given).",
                y=UNIT_RANGE,
            )
        )
    for position in vocab.TURN_POSITIONS:
        series = [
            vocab.turn_state(position, s)
            for s in vocab.TURN_STATES
            if vocab.turn_state(position, s) in names
        ]
        if not series:
            continue
        traces = [_state_trace(name, TURN_STATE_COLORS) for name in series]
        which = {"1": "first", "2": "second", "3+": "third and later"}[position]
        out.append(
            figure(
                f"turn-states-{position}",
                f"Model turn {position}: structure",
                traces,
                help=f"Share of the {which} model turns per step that are a healthy call, a "
                "call with stray text, a call left open (cut), end-of-turn inside a call, or no "
                "call (an answer or text).",
                y={"range": [0, 1.02]},
            )
        )
    return out


def _structure(names: set[str]) -> list[dict[str, Any]]:
    """Charts of the trainer's positional probes, structural states and id-position probes."""
    return _probe_chart(names) + _states_chart(names) + _ids_chart(names)


def _probe_chart(names: set[str]) -> list[dict[str, Any]]:
    """The positional probes' chart: each control token where it breaks or ends the call."""
    probes = [p for p in vocab.POSITIONAL_PROBES if vocab.probe(p) in names]
    if not probes:
        return []
    traces = []
    for i, probe in enumerate(probes):
        color = TOKEN_COLORS[i % len(TOKEN_COLORS)]
        traces += line(vocab.probe(probe), vocab.POSITIONAL_PROBES[probe][1], color)
    return [
        figure(
            "probes",
            "Control tokens where they matter",
            traces,
            help="Mean probability, per step, of a control token at the position where it "
            "breaks or ends the call. End-of-turn right after the opening tag is the collapse "
            "signal. The key gives each line's last value: lines at 0 and at 1 lie on one "
            "another.",
            alerts=["control_token_spike", "collapse"],
            wide=True,  # five keys: on a third of a row they took half the card
            y=UNIT_RANGE,
        )
        | {"legend_last": True}
    ]


def _states_chart(names: set[str]) -> list[dict[str, Any]]:
    """The share of completions in each structural state, per step."""
    states = [vocab.state(s) for s in vocab.STATES if vocab.state(s) in names]
    states += sorted(n for n in names if n.startswith(vocab.state("")) and n not in states)
    if not states:
        return []
    return [
        figure(
            "states",
            "Structural state of completions",
            [_state_trace(n) for n in states],
            help="Share of completions per step that are a healthy call, a call with stray "
            "text, a collapsed call, or no call at all.",
            alerts=["collapse"],
            y={"range": [0, 1.02]},
        )
    ]


def _ids_chart(names: set[str]) -> list[dict[str, Any]]:
    """At the id position: the target's and its best rival's logprob, and the ids' entropy."""
    ids = [n for n in ("target_logprob", "rival_logprob") if vocab.probe(n) in names]
    if not ids:
        return []
    traces = []
    for n, color in zip(ids, (COLORS["true_accuracy"], NEUTRAL), strict=False):
        traces += line(vocab.probe(n), n.replace("_", " "), color)
    if vocab.probe("id_entropy") in names:
        traces += line(
            vocab.probe("id_entropy"),
            "id entropy (bits)",
            COLORS["vote_entropy"],
            dash="dot",
            axis="y2",
        )
    return [
        figure(
            "ids",
            "At the id position",
            traces,
            help="Log-probability of the target id and of its best listed rival, and the "
            "entropy over listed ids (right).",
            y2={"title": {"text": "bits"}, "rangemode": "tozero"},
        )
    ]


# How each part of a probe is drawn on its detail chart: (part, name, color or None for the
# probe's own color, dash). The page shows this key once above the charts.
PROBE_STYLES = {
    "mean": ("mean", None, "solid"),
    "p90": ("p90", None, "dash"),
    "max": ("max", None, "dot"),
    "reward1": ("mean, reward 1", "#16a34a", "solid"),
    "reward0": ("mean, reward 0", "#dc2626", "solid"),
    "supervised": ("mean, supervised", "#0284c7", "dashdot"),
    "policy": ("mean, on-policy", "#64748b", "dashdot"),
}
PROBE_PARTS = tuple(
    (part if part in vocab.PROBE_STATS else f"{part}/mean", *PROBE_STYLES[part])
    for part in (*vocab.PROBE_STATS, *vocab.PROBE_SPLITS)
)


def probe_details(names: set[str]) -> list[dict[str, Any]]:
    """One chart per probe: its mean, p90 and max, and its mean split by reward and by origin."""
    out = []
    titles = {p: title for p, (title, _) in vocab.POSITIONAL_PROBES.items()} | vocab.ID_PROBES
    for i, (probe, title) in enumerate(titles.items()):
        color = TOKEN_COLORS[i % len(TOKEN_COLORS)]
        traces = []
        for suffix, name, part_color, dash in PROBE_PARTS:
            series = vocab.probe(probe, suffix)
            if series in names:
                traces += line(series, name, part_color or color, dash=dash)
        if not traces:
            continue
        fig = figure(
            f"probe-{probe}",
            title[:1].upper() + title[1:],
            traces,
            alerts=["control_token_spike"] if probe in vocab.POSITIONAL_PROBES else [],
            y=UNIT_RANGE if probe in vocab.POSITIONAL_PROBES else None,
        )
        fig["layout"]["showlegend"] = False  # the key above the charts names the lines
        out.append(fig)
    return out


EVAL_COLORS = {
    "id": "#2563eb",
    "format_ood": "#ea580c",
    "content_ood": "#9333ea",
    "validation": "#0891b2",
}
SFT_SERIES = vocab.SFT_LOSS


def _markers(traces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sparse series (every E steps) as lines with markers, never smoothed (an evaluation is a
    measurement of its own, not a noisy step)."""
    for trace in traces:
        trace["meta"]["sparse"] = True
        if trace["meta"]["part"] == "y":
            trace["mode"] = "lines+markers"
            trace["marker"] = {"size": 6, "color": trace["line"]["color"]}
    return traces


def evaluation(names: set[str]) -> list[dict[str, Any]]:
    """Greedy evaluation accuracy (ID, format-OOD, content-OOD) and the SFT phases' loss."""
    out = []
    traces = []
    for name, (legend, _) in vocab.EVAL_SETS.items():
        if vocab.eval_set(name) in names:
            traces += _markers(line(vocab.eval_set(name), legend, EVAL_COLORS[name]))
    if traces:
        out.append(
            figure(
                "eval",
                "Evaluation accuracy (greedy)",
                traces,
                help="Every E steps: the training queries (in-distribution), the same queries "
                "asking for another reply format (format-OOD; single-turn runs), held-out "
                "paraphrases (content-OOD). A multi-turn run plays each through the tool loop. "
                "A verl run's validation: the mean true score (else score) of its validation "
                "dump.",
                y=UNIT_RANGE,
            )
        )
    if SFT_SERIES in names:
        out.append(
            figure(
                "sft",
                "SFT phases: loss",
                _markers(line(SFT_SERIES, "SFT loss", "#0d9488")),
                help="Mean loss of each supervised phase, at the step after which it ran; the "
                "phases are the shaded bands on every chart.",
            )
        )
    return out


MISMATCH_COLOR = "#0891b2"
# What the mismatch section says above its charts: what r is, the bands, the alert.
MISMATCH_TEXT = (
    "r = p_trainer / p_generator of each sampled completion token (log r = trainer − generator "
    "logprob), over the tokens both sides scored: a tool result, or a token the generator gave "
    "no logprob for, is left out. Bands: the share of tokens whose r lies outside "
    f"[1/{mm.BANDS[0]:g}, {mm.BANDS[0]:g}] and [1/{mm.BANDS[1]:g}, {mm.BANDS[1]:g}], where "
    "token-level TIS truncates and MIS masks. Sequence ratio: Π r over a rollout's tokens (min, "
    "mean and max over the step's rollouts). The mismatch alert fires at a step whose k3 "
    f"KL(generator ‖ trainer) ≥ {AlertThresholds().mismatch_k3:g} (verl's K3 rejection default)."
)


Line = tuple[str, str, str, str]  # a chart's line: series, legend, dash, y axis
# The mismatch charts: (id, title, lines, help), in the section's order.
MISMATCH_CHARTS: tuple[tuple[str, str, tuple[Line, ...], str], ...] = (
    (
        "mismatch-diff",
        "|Δlogp| mean · max",
        ((mm.ABS_DIFF_MEAN, "mean", "solid", "y"), (mm.ABS_DIFF_MAX, "max (right)", "dot", "y2")),
        "Per step, the mean (left) and the largest (right) |trainer − generator logprob| of the "
        "sampled tokens.",
    ),
    (
        "mismatch-k3",
        "k3 KL(generator ‖ trainer)",
        ((mm.K3_KL, "k3 KL", "solid", "y"),),
        "The mean of r − 1 − log r over the step's tokens: an unbiased estimate of the KL from "
        "the generator's distribution to the trainer's, never negative.",
    ),
    (
        "mismatch-seq",
        "Sequence ratio min · mean · max",
        tuple(
            (name, name.rsplit("_", 1)[1], dash, "y")
            for name, dash in zip(
                (mm.SEQ_RATIO_MIN, mm.SEQ_RATIO_MEAN, mm.SEQ_RATIO_MAX),
                ("dot", "solid", "dash"),
                strict=True,
            )
        ),
        "Π r over each rollout's compared tokens: 1 where the trainer would have sampled it as "
        "likely as the generator did.",
    ),
    (
        "mismatch-bands",
        "Tokens outside the bands",
        tuple(
            (name, f"outside [1/{band:g}, {band:g}]", dash, "y")
            for name, band, dash in zip(
                (mm.OUTSIDE_2X, mm.OUTSIDE_5X), mm.BANDS, ("solid", "dot"), strict=True
            )
        ),
        "The share of the step's compared tokens whose ratio lies outside each band.",
    ),
)


def mismatch_charts(names: set[str]) -> list[dict[str, Any]]:
    """The training–inference mismatch charts (MISMATCH_CHARTS: core.mismatch's per-step
    figures) where the run recorded their series; k3 KL shows the mismatch alert."""
    out = []
    for fid, title, lines, help_text in MISMATCH_CHARTS:
        traces = []
        for name, legend, dash, axis in lines:
            if name in names:
                traces += line(name, legend, MISMATCH_COLOR, dash=dash, axis=axis)
        if not traces:
            continue
        right = any(axis == "y2" for *_, axis in lines)
        fig = figure(
            fid,
            title,
            traces,
            help=help_text,
            alerts=["mismatch"] if fid == "mismatch-k3" else [],
            y={"rangemode": "tozero"},
            y2={"rangemode": "tozero"} if right else None,
        )
        out.append(fig)
    return out


def _used(figs: Sequence[dict[str, Any]]) -> set[str]:
    return {t["meta"]["series"] for f in figs for t in f["data"] if "series" in t.get("meta", {})}


def _optimization_notes(name: str, config: dict[str, Any] | None) -> dict[str, str]:
    """What an optimization chart must say for the run's config: KL is not computed at β = 0,
    and GRPO's loss is then 0 by construction (while its gradient is not)."""
    if not config or config.get("kl_coef") != 0:
        return {}
    if name == "kl":
        return {"empty": "not computed (β = 0)", "help": "TRL computes KL only when β > 0."}
    if name == "loss" and config.get("num_iterations", 1) == 1:
        return {
            "help": "0 by construction at β = 0 with one update per batch: a group's advantages "
            "sum to 0 and the policy ratio is 1. Its gradient is not 0: read grad norm."
        }
    return {}


def run_figures(
    control_tokens: Sequence[str], names: Sequence[str], config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The run page's charts (empty; the page fills them): main, structure (states and probes),
    probe details, evaluation, training–inference mismatch, optimization, and every other
    recorded series grouped by prefix
    (trl/…) for a lazily opened section; `config` (a launch config) adds what its settings
    explain (KL at β = 0)."""
    have = set(names)
    main = _main_charts(control_tokens, have)
    structure = _structure(have)
    tools = tool_use(have)
    probes = probe_details(have)
    evals = evaluation(have)
    mismatch = mismatch_charts(have)
    shown = (
        _used(main)
        | _used(structure)
        | _used(tools)
        | _used(probes)
        | _used(evals)
        | _used(mismatch)
        | set(STEP_SERIES)
    )
    return {
        "main": main,
        "structure": structure,
        "tools": tools,
        "probes": probes,
        "evaluation": evals,
        "mismatch": mismatch,
        "optimization": _optimization(have, config),
        "other": _other(names, shown),
    }


def _main_charts(control_tokens: Sequence[str], have: set[str]) -> list[dict[str, Any]]:
    """The run page's first charts: reward against true accuracy, their buckets, the group's
    votes, format validity and, where recorded, the control tokens' probabilities."""
    c = COLORS
    main = [
        figure(
            "reward",
            "Verifier reward vs true accuracy",
            line("reward_mean", label("reward_mean"), c["reward_mean"])
            + line("true_accuracy", label("true_accuracy"), c["true_accuracy"])
            + (line(FREE, label(FREE), c["true_accuracy"], dash="dot") if FREE in have else []),
            help="Per step. The policy trains on the verifier's reward; true accuracy is exact "
            "match with the target. Format-free accuracy (dotted, where recorded) reads the "
            "answer whatever the structure around it: a gap between it and true accuracy is a "
            "skill hidden by a broken format.",
            alerts=["reward_hacking"],
            y=UNIT_RANGE,
        ),
        figure(
            "buckets",
            f"{WINDOW}-step buckets",
            _bucket_lines("reward_mean", c["reward_mean"])
            + _bucket_lines("true_accuracy", c["true_accuracy"]),
            help=f"Mean of steps 1–{WINDOW}, {WINDOW + 1}–{2 * WINDOW}, …, drawn over the steps "
            "each holds, the dot at its centre; dotted and open: the bucket still filling. A run "
            f"has converged at the end of the first closed bucket whose true accuracy reaches "
            f"{CONVERGED}.",
            alerts=["reward_hacking"],
            y=UNIT_RANGE,
        ),
        figure(
            "votes",
            "Vote agreement · vote entropy",
            line("vote_agreement", label("vote_agreement"), c["vote_agreement"])
            + line("vote_entropy", label("vote_entropy"), c["vote_entropy"], axis="y2"),
            help="Share of the group voting for the modal id (left) and the entropy of the group's votes (right).",
            y=UNIT_RANGE,
            y2={"title": {"text": "bits"}, "rangemode": "tozero"},
        ),
        figure(
            "format",
            "Format-valid rate · zero-std groups",
            line("format_valid_rate", label("format_valid_rate"), c["format_valid_rate"])
            + line("zero_std_share", label("zero_std_share"), c["zero_std_share"], dash="dot")
            + [
                trace
                for name, text, color in GROUP_SPREAD
                if name in have
                for trace in line(name, text, color, dash="dash")
            ],
            help="Share of completions that are a well-formed call, and of groups whose rewards are all equal (no gradient): solved (all at the top reward) or stuck (all below it).",
            alerts=["collapse", "signal_loss", "solved"],
            y=UNIT_RANGE,
        ),
    ]
    return main + _control_chart(control_tokens, have)


def _control_chart(control_tokens: Sequence[str], have: set[str]) -> list[dict[str, Any]]:
    """Each control token's max and mean probability over completion positions, per step."""
    control = _control_traces(control_tokens, have)
    if not control:
        return []
    return [
        figure(
            "control",
            "Control-token probabilities",
            control,
            help="Per step, the max (solid) and mean (dotted) over completion positions of each control token's probability.",
            alerts=["control_token_spike"],
            wide=True,
            y=UNIT_RANGE,
        )
    ]


def _optimization(have: set[str], config: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A small chart per optimization series recorded (loss, KL, grad norm, …)."""
    optimization = []
    for n in vocab.OPTIMIZATION:
        if n in have:
            notes = _optimization_notes(n, config)
            optimization.append(
                figure(
                    f"s-{n}",
                    label(n),
                    line(n, label(n), NEUTRAL),
                    small=True,
                    help=notes.get("help", ""),
                    empty=notes.get("empty", ""),
                )
            )
    return optimization


def _other(names: Sequence[str], shown: set[str]) -> list[dict[str, Any]]:
    """Every series no other chart shows, a small chart each, grouped by prefix (trl/…)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for i, name in enumerate(n for n in names if n not in shown):
        prefix = name.split("/", 1)[0] if "/" in name else "other"
        groups.setdefault(prefix, []).append(
            figure(f"m-{i}", name, line(name, name, NEUTRAL), small=True)
        )
    return [{"title": prefix, "figures": figs} for prefix, figs in sorted(groups.items())]


def section(
    sid: str,
    title: str = "",
    *,
    group: str | None = None,
    note: str = "",
    grid: int = 2,
    key: str = "",
    text: str = "",
    always: bool = False,
) -> dict[str, Any]:
    """A chart section of a page: the figures of `group` (default: sid) in a `grid`-column grid
    (element id charts-<sid>), under `title` (and its short `note`), with a paragraph `text` and
    a partial `key` above them; shown only when it has figures, unless `always`."""
    return {
        "id": sid,
        "group": group or sid,
        "title": title,
        "note": note,
        "grid": grid,
        "key": key,
        "text": text,
        "always": always,
    }


# The chart sections the pages render and their scripts draw, in order (run_figures' and
# compare_figures' groups).
RUN_SECTIONS = [
    section("main", always=True),
    section("structure", "Call structure", grid=3),
    section("tools", "Tool use, turn by turn", grid=3),
    section("probes", "Probes in detail", grid=4, key="_probe_key.html"),
    section("evaluation", "Evaluation and SFT"),
    section("mismatch", "Training–inference mismatch", text=MISMATCH_TEXT),
    section("optimization", "Optimization", grid=4),
]
COMPARE_SECTIONS = [
    section("compare", group="main", always=True),
    section(
        "control", "Control-token probabilities", note="(mean over completion positions)", grid=3
    ),
    section("evaluation", "Evaluation", note="(greedy accuracy every E steps)", grid=3),
    section("collapse", "Collapse"),
    section("tools", "Tool use", note="(tool-calling runs)", grid=3),
    section("mismatch", "Training–inference mismatch", grid=4, text=MISMATCH_TEXT),
]


# counts and mismatch figures, not shares (or shares far below 1): no unit range
NOT_SHARES = (vocab.TOOL_CALLS, vocab.TOOL_TURNS, *mm.NAMES)


def compare_figures(
    runs: Sequence[Mapping[str, Any]],
    series_by_run: dict[str, dict[str, Any]],
    names: Sequence[str],
    *,
    bands: bool = True,
) -> dict[str, list[dict[str, Any]]]:
    """Each run's series overlaid on shared-step charts, one color per run: main, control,
    evaluation and collapse (the last two only where some run recorded them).

    The traces come empty, tagged with meta {series, run, part}: the page sends each run's
    series once beside them and its script fills them (a step axis per series, not per trace).
    Without `bands`, a run's series is its mean line alone."""
    tokens: list[str] = []
    for run in runs:
        tokens += [t for t in run["control_tokens"] if t not in tokens]

    def overlay(fid: str, name: str, title: str) -> dict[str, Any] | None:
        traces = []
        for j, run in enumerate(runs):
            if name in series_by_run[str(run["id"])]["series"]:
                color = RUN_COLORS[j % len(RUN_COLORS)]
                drawn = line(name, f"#{run['id']} {run['name']}", color, run_id=run["id"])
                traces += drawn if bands else drawn[2:]
        y = {"rangemode": "tozero"} if name in NOT_SHARES else UNIT_RANGE
        return figure(fid, title, traces, y=y) if traces else None

    main = [overlay(f"c-{i}", n, label(n).capitalize()) for i, n in enumerate(names)]
    control = [overlay(f"t-{i}", vocab.ctrl(t, "mean"), t) for i, t in enumerate(tokens)]
    out = {"main": [f for f in main if f], "control": [f for f in control if f]}
    out |= {"evaluation": [], "collapse": [], "tools": [], "mismatch": []}
    for i, (name, (section, title)) in enumerate(vocab.COMPARE_EXTRA.items()):
        fig = overlay(f"x-{i}", name, title)
        if fig is not None:
            if name in vocab.EVAL_SERIES:
                _markers(fig["data"])
            out[section].append(fig)
    return out
