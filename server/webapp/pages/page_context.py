"""What each page shows, from what the queries read: template context plus the page data its
script receives (pure: the routes pass the data and a `url(name, **params)` for links).

Each page's `page` dict is the one way data reaches a script: base.html writes it into the
`page-data` JSON block, and the script reads it with RL.pageData().
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlencode

from pydantic import ValidationError
from rollout_lens.server.core import analysis, vocab
from rollout_lens.server.core.read_models import (
    GroupNav,
    LiveState,
    RunData,
    RunOverviewData,
    StepGroups,
)
from rollout_lens.server.core.records import DISAGREE_AT
from rollout_lens.server.core.step_views import CompareData, GroupDetail
from rollout_lens.server.core.task_vocab import BEFORE_RL_MODES
from rollout_lens.server.store.models import ACTIVE_STATUSES
from rollout_lens.server.webapp.pages import plotly_figures as figures
from rollout_lens.server.webapp.pages import viewer
from rollout_lens.server.webapp.pages.cells import Shade
from rollout_lens.server.webapp.pages.mismatch_page import seq_ratio_text
from rollout_lens.server.webapp.queries import (
    JSON_TEXT_BUDGET,
    JSON_TEXT_CHARS,
    MAX_RUNS_PER_PAGE,
    RUNS_PER_PAGE,
    RolloutQuery,
    chart_data,
)
from rollout_lens.server.webapp.queries.overview import GROUP_SORTS, LOOKS
from typing_extensions import TypedDict

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
        "listing": data,
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


class RunPageContext(TypedDict):
    """run.html's context."""

    run: RunData  # the run card (_run_card.html)
    live: LiveState
    last_step: int | None  # the step viewer's way in (None: no steps yet)
    alerts: list[dict[str, Any]]
    config: list[tuple[str, str]]  # the launch config as (dotted key, JSON value) rows
    figures: dict[str, list[dict[str, Any]]]
    sections: list[dict[str, Any]]
    full: bool  # every step drawn, not downsampled
    notice: str  # what a form action left for this page (server.webapp.http.flash)
    deliveries: str  # alerts that did not reach the alert webhook ("" if none)
    page: dict[str, Any]  # the page script's data
    chart_view: dict[str, Any]  # chart_data.chart_view(): default smoothing, folding rule


def run_page(
    overview: RunOverviewData, url: Url, *, full: bool, notice: str, deliveries: str = ""
) -> RunPageContext:
    """A run's card, alerts and chart sections (empty figures the script fills)."""
    run = overview["run"]
    run_id = run["id"]
    alerts = overview.get("alerts", [])
    names = overview["series_names"]
    names += [n for n in chart_data.expected_series(run["config"]) if n not in names]
    figs = figures.run_figures(run["control_tokens"], names, run["config"])
    page = {
        "run_id": run_id,
        "series": url("get_series", run_id=run_id),
        "alerts": url("get_alerts", run_id=run_id),
        "progress": url("get_progress", run_id=run_id),
        "steps": url("step_jump", run_id=run_id),
        "full": full,
        "max_points": chart_data.MAX_POINTS,
        "poll_ms": POLL_MS,
        "active": run["status"] in ACTIVE_STATUSES,
        "figures": figs,
        "sections": figures.RUN_SECTIONS,
        "initial_alerts": alerts,
        "no_steps": overview["last_step"] is None,
        "first_step": overview["first_step"],
        "sft_series": figures.SFT_SERIES if figures.SFT_SERIES in names else None,
        "sft_before_rl": (run["config"] or {}).get("supervision") in BEFORE_RL_MODES,
    }
    return {
        "run": run,
        "live": overview["live"],
        "last_step": overview["last_step"],
        "alerts": alerts,
        "config": chart_data.config_rows(chart_data.shown_config(run)),
        "figures": figs,
        "sections": figures.RUN_SECTIONS,
        "full": full,
        "notice": notice,
        "deliveries": deliveries,
        "page": page,
        "chart_view": chart_data.chart_view(),
    }


def group_view(detail: GroupDetail) -> viewer.GroupView | None:
    """A group_detail's rollouts as the viewer shows them (viewer.group_views: each with its
    token cells and control-token rows within the page's token budget); None for no rollouts."""
    if not detail["rollouts"]:
        return None
    (shown,) = viewer.group_views(detail["rollouts"])
    return shown


class StepPageContext(TypedDict):
    """step.html's context (and its partials': _step_nav, _step_stats, _groups, _group)."""

    detail: StepGroups | GroupDetail  # the step as shown: its groups, or its only group
    step_groups: StepGroups  # the groups overview
    run: RunData
    group: viewer.GroupView | None  # group_view of the only group shown whole
    group_index: int | None
    overview: bool  # the groups overview is shown (not one group)
    disagree_reward: float
    columns: list[dict[str, Any]]
    looks: list[dict[str, Any]]
    all_groups: str
    links: dict[str, str | None]
    keep_query: dict[str, Any]
    shade: Shade  # what the token view is shaded by (a group with a generator side)
    mismatch_url: str | None  # the step's mismatch drill-down, where it has a generator side


def step_page(
    overview: StepGroups,
    url: Url,
    *,
    detail: GroupDetail | None = None,
    shade: Shade = "probability",
    mismatch: bool = False,
) -> StepPageContext:
    """A step: its groups overview (step_groups: sortable rows, filters for the groups that need
    a look, pages), or with one group (`detail`: group_detail) that group's rollouts as today,
    its tokens shaded by `shade`; `mismatch`: its rollouts have a generator side (the
    drill-down is linked)."""
    run, step = overview["run"], overview["step"]["step"]
    sort, order, look = overview["sort"], overview["order"], overview["look"]

    def here(**changes: Any) -> str:
        query = _overview_query({"sort": sort, "order": order, "look": look} | changes)
        path = url("step_page", run_id=run["id"], step=step)
        return f"{path}?{urlencode(query)}" if query else path

    offset, limit, total = overview["offset"], overview["limit"], overview["total"]
    looks = [
        {
            "key": key,
            "label": label,
            "count": overview["counts"][key],
            "active": key == look,
            "href": here(look=None if key == look else key),
        }
        for key, label in LOOKS.items()
    ]
    group = group_view(detail) if detail is not None else None
    return {
        "detail": overview if detail is None else detail,
        "step_groups": overview,
        "run": run,
        "group": group,
        "group_index": group["group"] if group else None,
        "overview": detail is None,
        "disagree_reward": DISAGREE_AT,
        "columns": _sort_columns(sort, order, here),
        "looks": looks,
        "all_groups": here(look=None),
        "links": {
            "prev": here(offset=max(0, offset - limit)) if offset > 0 else None,
            "next": here(offset=offset + limit) if offset + limit < total else None,
        },
        # what the step links keep: the overview's sort and filter
        "keep_query": _overview_query({"sort": sort, "order": order, "look": look}),
        "shade": shade,
        "mismatch_url": f"{url('mismatch_page', run_id=run['id'])}?step={step}"
        if mismatch
        else None,
    }


def _sort_columns(sort: str, order: str, here: Callable[..., str]) -> list[dict[str, Any]]:
    """The groups overview's sortable columns, each with its link: a column first sorts the way
    that brings the ones to look at up (high first), the sorted one the other way."""
    return [
        {
            "key": key,
            "label": label,
            "numeric": numeric,
            "active": key == sort,
            "href": here(
                sort=key,
                order=("asc" if order == "desc" else "desc")
                if key == sort
                else ("asc" if key in ("group", "label") else "desc"),
            ),
        }
        for key, (label, numeric) in GROUP_SORTS.items()
    ]


def _overview_query(params: dict[str, Any]) -> dict[str, Any]:
    """An overview URL's parameters without the defaults (group order, ascending, no filter,
    the first page)."""
    defaults = {"sort": "group", "order": "asc", "look": None, "offset": 0}
    return {k: v for k, v in params.items() if v not in (None, "") and defaults.get(k) != v}


def step_json(data: StepGroups, url: Url) -> dict[str, Any]:
    """A step's JSON twin: step_groups plus the links to the pages of groups around this one
    (None at either end), keeping the sort and the look."""
    run_id, step = data["run"]["id"], data["step"]["step"]
    offset, limit, total = data["offset"], data["limit"], data["total"]

    def at(start: int) -> str:
        params = {"sort": data["sort"], "order": data["order"], "look": data["look"]}
        query: dict[str, str | int] = {k: v for k, v in params.items() if v is not None}
        query |= {"offset": start, "limit": limit}
        return f"{url('get_step', run_id=run_id, step=step)}?{urlencode(query)}"

    return {
        **data,
        "links": {
            "prev": at(max(0, offset - limit)) if offset > 0 else None,
            "next": at(offset + limit) if offset + limit < total else None,
        },
    }


class GroupPageContext(TypedDict):
    """group.html's context (and its partials': _step_nav, _group)."""

    detail: GroupDetail
    run: RunData
    group: viewer.GroupView | None  # group_view: the rollouts as the viewer shows them
    group_index: int
    summary: dict[str, Any]
    gnav: GroupNav
    overview: bool  # always False: one group
    shade: Shade  # what the token view is shaded by (a group with a generator side)


def group_page(detail: GroupDetail, shade: Shade = "probability") -> GroupPageContext:
    """One group of a step: its rollouts (tabs, tokens shaded by `shade`) and the table of all
    of them, with links to the groups around it and to the step's overview."""
    return {
        "detail": detail,
        "run": detail["run"],
        "group": group_view(detail),
        "group_index": detail["summary"]["group"],
        "summary": detail["summary"],
        "gnav": detail["group_nav"],
        "overview": False,
        "shade": shade,
    }


def group_json(detail: GroupDetail, url: Url, *, limit: int, max_tokens: int) -> dict[str, Any]:
    """A group's JSON twin: group_detail with each rollout as viewer.rollout_json sends it (the
    read view's data() and the marks the page shows), and the link to its next page of
    rollouts (None at the end)."""
    run_id, step = detail["run"]["id"], detail["step"]["step"]
    group = detail["summary"]["group"]
    end = detail["offset"] + len(detail["rollouts"])
    path = url("get_group", run_id=run_id, step=step, group=group)
    cut = max(JSON_TEXT_CHARS, JSON_TEXT_BUDGET // max(limit, 1))
    rollouts = [viewer.rollout_json(r, cut) for r in detail["rollouts"]]
    return {
        **detail,
        "rollouts": rollouts,
        "limit": limit,
        "max_tokens": max_tokens,
        "next": f"{path}?{urlencode({'offset': end, 'limit': limit, 'max_tokens': max_tokens})}"
        if end < detail["rollouts_total"]
        else None,
    }


def compare_json(data: CompareData) -> dict[str, Any]:
    """Compare's JSON twin: queries.compare with the side-by-side rollouts as their JSON
    (RolloutView.data)."""
    sides = [
        side
        if side["detail"] is None
        else side
        | {"detail": side["detail"] | {"rollouts": [r.data() for r in side["detail"]["rollouts"]]}}
        for side in data["side_by_side"]
    ]
    return {**data, "side_by_side": sides}


class ComparePageContext(TypedDict):
    """compare.html's context (and _step_card.html's, one `detail` a side)."""

    compare: CompareData
    figures: dict[str, list[dict[str, Any]]]
    sections: list[dict[str, Any]]
    colors: dict[int, int]  # run id → its color's index (CSS class run-c{i})
    page: dict[str, Any]
    eval_columns: list[tuple[str, str]]
    converged: float  # analysis.CONVERGED, for the summary's explanation
    chart_view: dict[str, Any]  # chart_data.chart_view(): default smoothing, folding rule


def compare_page(data: CompareData, url: Url) -> ComparePageContext:
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
        "group": data["group"],
        "max_step": data["max_step"],
        "pair": [s["run_id"] for s in data["side_by_side"]],
        "steps": {s["run_id"]: url("step_jump", run_id=s["run_id"]) for s in data["side_by_side"]},
    }
    # Evaluation columns only when some run evaluated (runs without it would show dashes).
    evaluated = {n for summary in data["summary"] for n, v in summary["final_eval"].items() if v}
    return {
        "compare": data,
        "figures": figs,
        "sections": figures.COMPARE_SECTIONS,
        "colors": colors,
        "page": page,
        "eval_columns": [(n, label) for n, label in EVAL_COLUMNS if n in evaluated],
        "converged": analysis.CONVERGED,
        "chart_view": chart_data.chart_view(),
    }


# --- rollout explorer ---------------------------------------------------------------------------

EXPLORER_COLUMNS = (  # (sort key, header, numeric)
    ("step", "Step", True),
    ("group", "Group", True),
    ("index", "#", True),
    ("vote", "Vote", False),
    ("target", "Target", False),
    ("reward", "Reward", True),
    ("true_score", "True", True),
    ("advantage", "Adv.", True),
    ("abs_advantage", "|Adv.|", True),
    ("sum_logprob", "Σ logprob", True),
    ("length", "Tokens", True),
    ("state", "State", False),
)
# shown where the run has a generator side (generator_side): training–inference mismatch
MISMATCH_COLUMNS = (
    ("abs_diff_max", "max |Δlogp|", True),
    ("seq_ratio", "Seq. ratio", True),
)


def _explorer_url(path: str, filters: dict[str, Any], **changes: Any) -> str:
    params = {k: v for k, v in (filters | changes).items() if v is not None and v != ""}
    params = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items()}
    return f"{path}?{urlencode(params)}" if params else path


def explorer_urls(data: dict[str, Any], url: Url, *, run_id: int) -> dict[str, Any]:
    """The explorer's data with each row's links (its step, group and rollout) and the next
    page's URL."""
    for row in data["rollouts"]:
        row["step_url"] = url("step_page", run_id=run_id, step=row["step"])
        row["group_url"] = url("group_page", run_id=run_id, step=row["step"], group=row["group"])
        row["rollout_url"] = f"{row['group_url']}#r{row['index']}"
    filters = data["filters"]
    data["next_url"] = (
        None
        if data["next"] is None
        else _explorer_url(url("list_rollouts", run_id=run_id), filters, after=data["next"])
    )
    return data


# The state filter's choices: every structural state a rollout row can hold.
EXPLORER_STATES = tuple(dict.fromkeys([*vocab.STATES, *vocab.TURN_STATES]))
_FORM_BOOLEANS = {"true": True, "false": False}


def explorer_path(url: Url, run_id: int, params: list[tuple[str, str]]) -> str:
    """The explorer's URL with `params` (the filters as given, in their order)."""
    path = url("explorer_page", run_id=run_id)
    return f"{path}?{urlencode(params)}" if params else path


def explorer_invalid(
    run: Mapping[str, Any], given: dict[str, str], error: Exception, url: Url
) -> dict[str, Any]:
    """The explorer when its filters do not parse: the form as typed, each bad field with its
    reason (`errors`: field → message; "" for what no field holds), no rows."""
    fields = RolloutQuery.model_fields
    errors: dict[str, str] = {}
    for loc, message, kind in _reasons(error):
        if loc in fields:
            errors.setdefault(loc, message)
        elif kind == "extra_forbidden":
            errors.setdefault("", f"{loc} is not a filter of this page")
        else:
            errors.setdefault("", f"{loc}: {message}" if loc else message)
    path = url("explorer_page", run_id=run["id"])
    typed = {
        k: _FORM_BOOLEANS.get(v, v) if k in ("format_valid", "disagree", "alert") else v
        for k, v in given.items()
    }
    return {
        "run": run,
        "rows": [],
        "total": 0,
        "total_capped": False,
        "f": dict.fromkeys(fields) | RolloutQuery().filters() | typed,
        "errors": errors,
        "mismatch": _asks_mismatch(given),
        "states": EXPLORER_STATES,
        "headers": [],
        "first_url": path,
        "next_page_url": None,
        "json_url": explorer_path(url, run["id"], list(given.items())),
        "run_url": url("run_page", run_id=run["id"]),
        "path": path,
    }


def _reasons(error: Exception) -> list[tuple[str, str, str]]:
    """(field, message, kind) for each thing wrong with the explorer's parameters."""
    if isinstance(error, ValidationError):
        return [
            (
                str(e["loc"][0]) if e["loc"] else "",
                str(e["msg"]).removeprefix("Value error, "),
                str(e["type"]),
            )
            for e in error.errors()
        ]
    field, _, message = str(error).partition(": ")  # InvalidInput: "after: not a cursor …"
    return [(field, message, "")] if message else [("", str(error), "")]


def explorer_page(data: dict[str, Any], url: Url, *, run_id: int) -> dict[str, Any]:
    """The explorer page: its rows, the filter form's values, sort links that keep the filters,
    the next page and the JSON twin."""
    data = explorer_urls(data, url, run_id=run_id)
    path = url("explorer_page", run_id=run_id)
    filters = data["filters"]
    sort, order = filters.get("sort", "step"), filters.get("order", "asc")
    shown = data["generator_side"] or _asks_mismatch(filters)
    headers = [
        {
            "key": key,
            "label": label,
            "numeric": numeric,
            "active": key == sort,
            "order": order if key == sort else None,
            "url": _explorer_url(
                path, filters, sort=key, order="desc" if key == sort and order == "asc" else "asc"
            ),
        }
        for key, label, numeric in _explorer_columns(shown)
    ]
    return {
        "run": data["run"],
        "rows": [r | {"seq_ratio": seq_ratio_text(r["log_seq_ratio"])} for r in data["rollouts"]],
        "mismatch": shown,
        "total": data["total"],
        "total_capped": data["total_capped"],
        "f": dict.fromkeys(RolloutQuery.model_fields) | RolloutQuery().filters() | filters,
        "errors": {},
        "states": EXPLORER_STATES,
        "headers": headers,
        "first_url": _explorer_url(path, filters),
        "next_page_url": None
        if data["next"] is None
        else _explorer_url(path, filters, after=data["next"]),
        "json_url": _explorer_url(url("list_rollouts", run_id=run_id), filters),
        "run_url": url("run_page", run_id=run_id),
        "path": path,
    }


def _asks_mismatch(filters: Mapping[str, Any]) -> bool:
    """Whether the explorer's filters or sort name a mismatch figure (their columns then show
    whatever the run holds)."""
    named = {"diff_min", "diff_max", "ratio_min", "ratio_max"}
    return bool(named & set(filters)) or filters.get("sort") in {k for k, _, _ in MISMATCH_COLUMNS}


def _explorer_columns(mismatch: bool) -> tuple[tuple[str, str, bool], ...]:
    """The explorer's columns: the mismatch figures' only where the run has them."""
    return EXPLORER_COLUMNS + (MISMATCH_COLUMNS if mismatch else ())


def alert_rollouts(alert: dict[str, Any], *, format_judged: bool = True) -> dict[str, str]:
    """The explorer's filters that show the rollouts an alert is about: those of its step, in
    a collapsed state for a collapse, where verifier and truth disagree over the reward-hacking
    window, broken (not format-valid) for a control-token spike when the run judged format
    validity (without a format function none is known invalid: the whole step)."""
    step = int(alert["step"])
    kind = alert["kind"]
    if kind == "reward_hacking":
        first = max(0, step - 2 * vocab.WINDOW + 1)
        return {"steps": f"{first}:{step}", "disagree": "true", "sort": "step", "order": "desc"}
    extra = {
        "collapse": {"state": "collapse"},
        "mismatch": {"sort": "abs_diff_max", "order": "desc"},  # the worst token's rollout first
    }
    if format_judged:
        extra["control_token_spike"] = {"format_valid": "false"}
    return {"steps": str(step), **extra.get(kind, {})}


def alert_mismatch(alert: Mapping[str, Any]) -> dict[str, str] | None:
    """The mismatch drill-down's parameters for a mismatch alert (its step); None for another
    kind."""
    return {"step": str(int(alert["step"]))} if alert["kind"] == "mismatch" else None
