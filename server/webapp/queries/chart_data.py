"""Pure builders for the dashboard: series shaping, 25-step buckets, summaries, config diffs.

Nothing here touches a database or a request: data in, data out (tested without a server).
The Plotly figures themselves are in server.webapp.pages.plotly_figures; the step viewer's shaping in server.webapp.pages (cells, turns, viewer).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rollout_lens.server.core import analysis, vocab
from rollout_lens.server.core.display import live_text
from rollout_lens.server.core.read_models import (
    BucketSummary,
    ConfigDiff,
    ConfigDiffRow,
    ProgressData,
    RunData,
)
from rollout_lens.server.core.task_vocab import SFT_MODES
from rollout_lens.server.core.vocab import WINDOW
from rollout_lens.server.store.models import ACTIVE_STATUSES

MAX_POINTS = 600  # points per chart series before steps are merged (about a chart's width)
# Past this many steps a chart page opens smoothed: with 8 rollouts a step's true accuracy
# moves in eighths and swings 0 ↔ 1 from step to step, which hides a run's climb. SMOOTHING is
# the EMA weight (charts.js): an effective window of about 10 steps.
SMOOTH_PAST_STEPS = 20
SMOOTHING = 0.9
# A chart is folded to one line only when each of its series has at least this many points and
# none changed: two evaluations or one filling bucket that agree say nothing yet.
FOLD_MIN_POINTS = 10


def chart_view() -> dict[str, Any]:
    """The chart pages' display rules, for their controls (partial _chart_controls.html)."""
    return {
        "smoothing": SMOOTHING,
        "smooth_past_steps": SMOOTH_PAST_STEPS,
        "fold_min_points": FOLD_MIN_POINTS,
    }


DOWNSAMPLING = (
    "Series longer than max_points steps are cut into buckets of `bucket` consecutive steps "
    "(a 1-2-5 width, so bucket edges stay put as a run grows). Each bucket sends its first "
    "recorded step as x, its mean as y, and its min and max as lo and hi; charts draw the mean "
    "as a line and min–max as a band, so a one-step spike stays visible as the band's edge. "
    "A whole long run is read from the 10/100/1000-step rollups the writer keeps current "
    "(the smallest rollup width at least the chosen width), so its cost does not grow with the "
    "run. full=1 returns every step."
)


def bucket_width(n_steps: int, max_points: int | None) -> int:
    """The smallest 1-2-5 width that cuts n_steps into at most max_points buckets."""
    if max_points is None or n_steps <= max_points:
        return 1
    scale = 1
    while True:
        for mult in (1, 2, 5):
            width = mult * scale
            if math.ceil(n_steps / width) + 1 <= max_points:  # +1: buckets are aligned to steps
                return width
        scale *= 10


def _has_data(values: Iterable[Any]) -> bool:
    return any(v is not None for v in values)


def raw_series(
    names: Sequence[str], rows: Sequence[Sequence[Any]]
) -> dict[str, dict[str, list[Any]]]:
    """(step, v1, v2, …) rows → name → {x, y}; series with no value at all are left out."""
    steps = [row[0] for row in rows]
    out = {}
    for i, name in enumerate(names, start=1):
        ys = [row[i] for row in rows]
        if _has_data(ys):
            out[name] = {"x": steps, "y": ys}
    return out


def bucketed_series(
    names: Sequence[str], rows: Sequence[Sequence[Any]]
) -> dict[str, dict[str, list[Any]]]:
    """(first step, mean1, min1, max1, mean2, …) rows → name → {x, y, lo, hi}."""
    steps = [row[0] for row in rows]
    out = {}
    for i, name in enumerate(names):
        base = 1 + 3 * i
        ys = [row[base] for row in rows]
        if _has_data(ys):
            out[name] = {
                "x": steps,
                "y": ys,
                "lo": [row[base + 1] for row in rows],
                "hi": [row[base + 2] for row in rows],
            }
    return out


def rollup_series(
    rows: dict[str, list[tuple[int, int, int, float, float, float]]],
) -> dict[str, dict[str, list[Any]]]:
    """store.rollup_series buckets → name → {x, y, lo, hi} (x: each bucket's first step)."""
    return {
        name: {
            "x": [b[0] for b in buckets],
            "y": [b[3] for b in buckets],
            "lo": [b[4] for b in buckets],
            "hi": [b[5] for b in buckets],
        }
        for name, buckets in rows.items()
        if buckets
    }


def bucket_table(rows: Sequence[Sequence[Any]]) -> dict[str, list[Any]]:
    """(bucket, count, accuracy, reward, format-valid) rows → column lists, with step ranges and
    where a chart draws each bucket (bucket_geometry)."""
    table: dict[str, list[Any]] = {
        k: []
        for k in ("index", "start", "end", "n", "true_accuracy", "reward_mean", "format_valid_rate")
    }
    for index, n, acc, reward, valid in rows:
        index = int(index)
        table["index"].append(index)
        table["start"].append(index * WINDOW + 1)
        table["end"].append((index + 1) * WINDOW)
        table["n"].append(int(n))
        table["true_accuracy"].append(acc)
        table["reward_mean"].append(reward)
        table["format_valid_rate"].append(valid)
    return table | bucket_geometry(table["start"], table["n"])


def bucket_geometry(starts: Sequence[int], counts: Sequence[int]) -> dict[str, list[Any]]:
    """Where a chart draws each bucket on the step axis the other charts share: a segment over
    the steps it holds (x0–x1; steps are recorded from each bucket's start without gaps), a
    marker at its centre, and `partial` where it holds fewer than WINDOW steps (still filling)."""
    x1 = [start + max(n, 1) - 1 for start, n in zip(starts, counts, strict=True)]
    return {
        "x0": list(starts),
        "x1": x1,
        "center": [(a + b) / 2 for a, b in zip(starts, x1, strict=True)],
        "partial": [n < WINDOW for n in counts],
    }


def run_progress(run: RunData) -> ProgressData:
    """The fields of a run that change while it trains (what a live page refreshes)."""
    progress: ProgressData = {
        "id": run["id"],
        "status": run["status"],
        "current_step": run["current_step"],
        "total_steps": run["total_steps"],
        "recent_true_accuracy": run["recent_true_accuracy"],
        "recent_reward": run["recent_reward"],
        "device_minutes": run["device_minutes"],
        "cost": run["cost"],
        "error": run["error"],
        "finished_at": run["finished_at"],
        "ended_by": None if run["status"] in ACTIVE_STATUSES else run["ended_by"],
        "phase": run["phase"],
        "active": run["status"] in ACTIVE_STATUSES,
        "text": {},
    }
    progress["text"] = live_text(progress)  # of the fields above (text is none of them)
    return progress


def steps_per_second(recent: Sequence[tuple[int, Any]]) -> float | None:
    """Training speed from recent (step, recorded_at) pairs, newest first; None until two steps
    of the current session are recorded a measurable time apart."""
    if len(recent) < 2:
        return None
    (last, t_last), (first, t_first) = recent[0], recent[-1]
    seconds = (t_last - t_first).total_seconds()
    return (last - first) / seconds if seconds > 0 and last > first else None


def duration_text(seconds: float) -> str:
    """2 h 05 min, 4 min 10 s, 35 s."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def live_summary(live: Mapping[str, Any]) -> str:
    """One line on where a run stands: its place in the queue, its speed and ETA, or its end."""
    status, step, total = live["status"], live["current_step"], live["total_steps"]
    if status == "queued":
        starting = str(live.get("phase") or "")
        if starting:  # a process took it (the demo, `train`): it starts, not waits
            return starting[:1].upper() + starting[1:]
        place = live.get("queue_position")
        if not place:
            return "Queued: waiting for a worker"
        ahead = f" ({place - 1} ahead)" if place > 1 else ""
        return f"Queued, {_ordinal(place)} in line{ahead}: waiting for a worker"
    if status == "running":
        text = f"Step {step} of {total}"
        rate, eta = live.get("steps_per_second"), live.get("eta_seconds")
        phase = live.get("phase")
        if phase:  # before its first step: building its model, loading, starting
            text = phase[:1].upper() + phase[1:]
        elif rate:
            text += f" · {rate:.2f} steps/s · ETA {duration_text(eta or 0)}"
        elif step == 0:
            text += " · the first step is under way…"
        else:
            text += " · measuring speed…"
        if live.get("cancel_requested"):
            text += " · stopping (cancel requested)"
        return text
    if status == "completed":
        return f"Completed all {total} steps" if step >= total else f"Completed at step {step}"
    checkpoint = live.get("checkpoint_step")
    resume = f" · last checkpoint at step {checkpoint}" if checkpoint else ""
    return f"{status.capitalize()} at step {step} of {total}{resume}"


def run_summary(run: RunData, buckets: dict[str, list[Any]]) -> BucketSummary:
    """Compare's summary row from a run's 25-step buckets (bucket_table) and its summary columns:
    converged = analysis.converged_at (the first closed 25-step bucket reaching 0.9 true accuracy);
    stability = spread (max − min) of the bucket accuracies from there on (0 is perfectly stable;
    swings between 0 and 1, as the seed's blog post reports for a leaky run, are 1); final =
    mean of the last 25 steps (the run's recent_true_accuracy and recent_reward, which the
    writer keeps current)."""
    ends, accuracy = buckets["end"], buckets["true_accuracy"]
    converged = analysis.converged_at(ends, accuracy, run["current_step"])
    return {
        "run_id": run["id"],
        "name": run["name"],
        "steps": run["current_step"],
        "converged_at": converged,
        "stability": analysis.bucket_spread(ends, accuracy, converged),
        "final_accuracy": run["recent_true_accuracy"],
        "final_reward": run["recent_reward"],
        "device_minutes": run["device_minutes"],
        "cost": run["cost"],
    }


def last_window_mean(points: dict[str, list[Any]] | None) -> float | None:
    """Mean of a series' chart points (`x`: steps, or each bucket's first step when downsampled)
    from its last WINDOW steps: the last 25 steps' mean, or for a long run its last buckets'."""
    if not points or not points.get("x"):
        return None
    first = points["x"][-1] - WINDOW
    ys = [y for x, y in zip(points["x"], points["y"], strict=True) if x > first and y is not None]
    return sum(ys) / len(ys) if ys else None


CHART_DIGITS = 4  # significant digits of a chart's values, relative to the series' largest


def _chart_values(values: Sequence[float | None], places: int | None) -> list[float | int | None]:
    """Values rounded to `places` decimals (None: as they are)."""
    if places is None:
        return list(values)
    return [None if v is None else round(v, places) for v in values]


def _chart_places(*parts: Sequence[float | None], digits: int = CHART_DIGITS) -> int | None:
    """The decimals that keep `digits` significant digits of the largest value in `parts`: a
    250-pixel chart and its 4-digit hover show no more (None when there is nothing to round)."""
    top = 0.0
    for part in parts:
        present = [v for v in part if v is not None]
        if present:
            top = max(top, max(present), -min(present))
    if not top or not math.isfinite(top):
        return None
    return digits - 1 - math.floor(math.log10(top))


def chart_series(
    entries: dict[str, dict[str, list[Any]]], *, bands: bool
) -> dict[str, dict[str, list[Any]]]:
    """Series as a chart needs them: steps, values rounded to CHART_DIGITS significant digits of
    the series' largest (JSON then carries ~7 characters a value instead of ~19), and the min–max
    band (lo, hi) only with `bands` and where buckets merged steps (raw steps have none)."""
    out = {}
    for name, entry in entries.items():
        parts = [p for p in (("y", "lo", "hi") if bands else ("y",)) if p in entry]
        places = _chart_places(*(entry[p] for p in parts))
        out[name] = {"x": list(entry["x"])} | {p: _chart_values(entry[p], places) for p in parts}
    return out


DIFF_COLUMNS = ("model", "variant", "k", "group_size", "prompts_per_step", "seed", "total_steps")


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out |= _flatten(inner, f"{prefix}{key}.")
        return out
    return {prefix.rstrip("."): value}


def shown_config(run: Mapping[str, Any]) -> dict[str, Any] | None:
    """A run's launch config with the values its own columns hold instead (k: a leaky run lists
    every tool, so its k is none there as on its card, the runs list and compare)."""
    config: dict[str, Any] | None = run.get("config")
    if not config:
        return config
    return config | {c: run.get(c) for c in DIFF_COLUMNS if c in config and c in run}


def config_rows(config: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A launch config as (dotted key, JSON value) rows for a table."""
    if not config:
        return []
    return [(key, json.dumps(value)) for key, value in sorted(_flatten(config).items())]


def config_diff(runs: Sequence[RunData]) -> ConfigDiff:
    """Keys whose values differ between runs (run columns and flattened launch config)."""
    flat = []
    for run in runs:
        values = _flatten(shown_config(run) or {})
        for column in DIFF_COLUMNS:  # the run's own columns win: they are what the pages show
            values[column] = run.get(column)
        flat.append(values)
    keys = sorted(set().union(*flat)) if flat else []
    rows: list[ConfigDiffRow] = []
    same = 0
    for key in keys:
        shown = ["—" if key not in f else json.dumps(f[key]) for f in flat]
        if len(set(shown)) == 1:
            same += 1
            continue
        rows.append({"key": key, "values": shown, "differs": [v != shown[0] for v in shown]})
    return {"rows": rows, "same": same}


def expected_series(config: dict[str, Any] | None) -> list[str]:
    """Series a run's launch config promises though they are not logged every step (evaluation
    every E steps, SFT phases): the page charts them before their first point arrives."""
    if not config:
        return []
    launched = [vocab.eval_set(n) for n in vocab.LAUNCHED_EVAL_SETS]
    out = launched if config.get("eval_every") else []
    if config.get("supervision") in SFT_MODES:
        out.append(vocab.SFT_LOSS)
    return out
