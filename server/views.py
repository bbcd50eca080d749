"""What each page shows, from what the queries read: template context plus the page data its
script receives (pure: the routes pass the data and a `url(name, **params)` for links).

Each page's `page` dict is the one way data reaches a script: base.html writes it into the
`page-data` JSON block, and the script reads it with RL.pageData().
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from rollout_lens.server import charts, figures, viewer
from rollout_lens.server import series as vocab
from rollout_lens.server.errors import NotFound
from rollout_lens.server.models import ACTIVE_STATUSES
from rollout_lens.server.queries import MAX_RUNS_PER_PAGE, RUNS_PER_PAGE

Url = Callable[..., str]  # route name and path params → path

POLL_MS = 2000  # how often a live page asks for new steps
EVAL_COLUMNS = tuple((vocab.eval_set(n), header) for n, (_, header) in vocab.EVAL_SETS.items())
RUN_COLUMNS = (  # (sort key, header, numeric) of the runs table's sortable columns
    ("name", "Run", False),
    ("status", "Status", False),
    ("progress", "Progress", False),
    ("variant", "Variant", False),
    ("model", "Model", False),
    ("k", "k", True),
    ("group_size", "G", True),
    ("seed", "Seed", True),
    ("accuracy", "True acc.", True),
    ("reward", "Reward", True),
    ("device_minutes", "Device-min", True),
    ("cost", "Cost", True),
    ("created", "Created", False),
)


def _runs_url(path: str, data: dict[str, Any], page: int, q: str, sort: str, order: str) -> str:
    """A page of the runs list at `path`, keeping the search, the sort and the page size."""
    params: dict[str, Any] = {"q": q, "sort": sort, "order": order, "page": page}
    if data["per_page"] != RUNS_PER_PAGE:
        params["per_page"] = data["per_page"]
    query = {k: v for k, v in params.items() if v not in (None, "")}
    return f"{path}?{urlencode(query)}"


def page_links(
    data: dict[str, Any], path: str, *, q: str, sort: str, order: str
) -> dict[str, str | None]:
    """The previous and next pages of a runs list at `path` (None at either end); from a page
    past the end, previous is the last page."""
    page, pages = data["page"], data["pages"]
    return {
        "prev": _runs_url(path, data, min(page - 1, pages), q, sort, order) if page > 1 else None,
        "next": _runs_url(path, data, page + 1, q, sort, order) if page < pages else None,
    }


def runs_json(data: dict[str, Any], url: Url, *, q: str, sort: str, order: str) -> dict[str, Any]:
    """The runs API's body: runs_page's page of runs plus the links to the pages around it."""
    return data | {"links": page_links(data, url("list_runs"), q=q, sort=sort, order=order)}


def runs_page(data: dict[str, Any], url: Url, *, q: str, sort: str, order: str) -> dict[str, Any]:
    """One page of the runs list, sortable, with what its script polls for."""
    runs = data["runs"]
    return {
        "runs": runs,
        "p": data,
        "links": page_links(data, url("runs_page"), q=q, sort=sort, order=order),
        "json_url": _runs_url(url("list_runs"), data, data["page"], q, sort, order),
        # a page size other than the default, which the search form keeps
        "per_page": data["per_page"] if data["per_page"] != RUNS_PER_PAGE else None,
        "q": q,
        "sort": sort,
        "order": order,
        "columns": RUN_COLUMNS,
        "page": {
            "poll_ms": POLL_MS,
            "active": [r["id"] for r in runs if r["status"] in ACTIVE_STATUSES],
            "newest": data["newest"] or 0,
            "q": q,
            "api": url("list_runs"),
            "poll_size": MAX_RUNS_PER_PAGE,
            "alerts": url("list_alerts"),
        },
    }


def run_page(overview: dict[str, Any], url: Url, *, full: bool, notice: str) -> dict[str, Any]:
    """A run's card, alerts and chart sections (empty figures the script fills)."""
    run = overview["run"]
    run_id = run["id"]
    names = overview["series_names"]
    names += [n for n in figures.expected_series(run["config"]) if n not in names]
    figs = figures.run_figures(run["control_tokens"], names, run["config"])
    page = {
        "run_id": run_id,
        "series": url("get_series", run_id=run_id),
        "alerts": url("get_alerts", run_id=run_id),
        "progress": url("get_progress", run_id=run_id),
        "steps": url("step_jump", run_id=run_id),
        "full": full,
        "max_points": charts.MAX_POINTS,
        "poll_ms": POLL_MS,
        "active": run["status"] in ACTIVE_STATUSES,
        "figures": figs,
        "sections": figures.RUN_SECTIONS,
        "initial_alerts": overview["alerts"],
        "no_steps": overview["last_step"] is None,
        "first_step": overview["first_step"],
        "sft_series": figures.SFT_SERIES if figures.SFT_SERIES in names else None,
        "sft_before_rl": (run["config"] or {}).get("supervision") == "sft_then_rl",
    }
    return {
        "o": overview,
        "run": run,
        "live": overview["live"],
        "config": charts.config_rows(charts.shown_config(run)),
        "figures": figs,
        "sections": figures.RUN_SECTIONS,
        "full": full,
        "notice": notice,
        "page": page,
    }


def step_page(detail: dict[str, Any], group: int) -> dict[str, Any]:
    """One group of a step, each rollout with its token cells and control-token rows."""
    groups = detail["groups"]
    if groups and not 0 <= group < len(groups):
        raise NotFound(
            f"step {detail['step']['step']} of run {detail['run']['id']} has no group {group}"
        )
    shown = groups[group] if groups else None
    if shown is not None:
        limit = viewer.page_token_limit(len(shown["rollouts"]))
        for rollout in shown["rollouts"]:
            rollout["cells"] = viewer.token_cells(rollout, limit)
            # A tool-calling rollout's turns each show their own positions' table rows.
            turns = rollout.get("sampled") is not None
            table = limit if turns else min(limit, viewer.TABLE_TOKENS)
            rollout["control_rows"] = viewer.control_rows(rollout, table)
            rollout["turn_views"] = viewer.turn_views(
                rollout, rollout["cells"], rollout["control_rows"]
            )
    return {"d": detail, "run": detail["run"], "group": shown, "group_index": group}


def compare_page(data: dict[str, Any], url: Url) -> dict[str, Any]:
    """Runs overlaid section by section, their summary and config diff, one step side by side."""
    figs = figures.compare_figures(
        data["runs"], data["series"], vocab.COMPARE_SERIES, bands=data["bands"]
    )
    # Run i is drawn in RUN_COLORS[i]; templates use the matching CSS class run-c{i}.
    colors = {run["id"]: i % len(figures.RUN_COLORS) for i, run in enumerate(data["runs"])}
    page = {
        "figures": [f for s in figures.COMPARE_SECTIONS for f in figs[s["group"]]],
        "series": data["series"],  # run id → its series: what fills the figures' traces
        "step": data["step"],
        "max_step": data["max_step"],
        "pair": [s["run_id"] for s in data["side_by_side"]],
        "steps": {s["run_id"]: url("step_jump", run_id=s["run_id"]) for s in data["side_by_side"]},
    }
    # Evaluation columns only when some run evaluated (runs without it would show dashes).
    evaluated = {n for summary in data["summary"] for n, v in summary["final_eval"].items() if v}
    return {
        "c": data,
        "figures": figs,
        "sections": figures.COMPARE_SECTIONS,
        "colors": colors,
        "page": page,
        "eval_columns": [(n, label) for n, label in EVAL_COLUMNS if n in evaluated],
    }
