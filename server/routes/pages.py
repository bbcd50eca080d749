"""HTML pages: runs, run, step viewer, compare (each has a JSON twin in server/routes/api.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from rollout_lens.server import charts, figures, launch, queries, viewer
from rollout_lens.server import series as vocab
from rollout_lens.server.deps import AlertCacheDep, SessionDep, render
from rollout_lens.server.errors import NotFound
from rollout_lens.server.models import ACTIVE_STATUSES
from rollout_lens.server.params import run_ids
from rollout_lens.server.responses import run_alerts

router = APIRouter(include_in_schema=False)

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


@router.get("/", name="runs_page")
def runs_page(
    request: Request,
    session: SessionDep,
    q: str = "",
    sort: str = "created",
    order: Literal["asc", "desc"] = "desc",
) -> HTMLResponse:
    runs = queries.list_runs(session, q=q, sort=sort, descending=order == "desc")
    context = {
        "runs": runs,
        "q": q,
        "sort": sort,
        "order": order,
        "columns": RUN_COLUMNS,
        "page": {
            "poll_ms": POLL_MS,
            "active": [r["id"] for r in runs if r["status"] in ACTIVE_STATUSES],
            "newest": max((r["id"] for r in runs), default=0),
            "q": q,
            "api": str(request.app.url_path_for("list_runs")),
            "alerts": str(request.app.url_path_for("list_alerts")),
        },
    }
    return render(request, "runs.html", context)


@router.get("/runs/new", name="new_run_page")
def new_run_page(
    request: Request, session: SessionDep, preset: str = "", clone: int | None = None
) -> HTMLResponse:
    """The launch form: RunConfig's defaults, a preset's values, or a run's config (Clone)."""
    source = None if clone is None else queries.run_card(session, run_id=clone)
    return render(request, "new_run.html", launch.start_form(preset, source))


@router.get("/runs/{run_id}", name="run_page")
def run_page(
    request: Request,
    session: SessionDep,
    cache: AlertCacheDep,
    run_id: int,
    full: bool = False,
    notice: str = "",
) -> HTMLResponse:
    overview = queries.run_overview(session, run_id=run_id)
    overview["alerts"] = run_alerts(session, cache, run_id)
    run = overview["run"]
    names = overview["series_names"]
    names += [n for n in figures.expected_series(run["config"]) if n not in names]
    figs = figures.run_figures(run["control_tokens"], names)
    page = {
        "run_id": run_id,
        "series": str(request.app.url_path_for("get_series", run_id=run_id)),
        "alerts": str(request.app.url_path_for("get_alerts", run_id=run_id)),
        "progress": str(request.app.url_path_for("get_progress", run_id=run_id)),
        "steps": str(request.app.url_path_for("step_jump", run_id=run_id)),
        "full": full,
        "max_points": charts.MAX_POINTS,
        "poll_ms": POLL_MS,
        "active": run["status"] in ACTIVE_STATUSES,
        "figures": figs,
        "initial_alerts": overview["alerts"],
        "no_steps": overview["last_step"] is None,
        "sft_series": figures.SFT_SERIES if figures.SFT_SERIES in names else None,
        "sft_before_rl": (run["config"] or {}).get("supervision") == "sft_then_rl",
    }
    context = {
        "o": overview,
        "run": run,
        "live": overview["live"],
        "config": charts.config_rows(run["config"]),
        "figures": figs,
        "full": full,
        "notice": notice,
        "page": page,
    }
    return render(request, "run.html", context)


@router.get("/runs/{run_id}/steps", name="step_jump")
def step_jump(
    request: Request, session: SessionDep, run_id: int, step: int | None = None
) -> RedirectResponse:
    found = queries.resolve_step(session, run_id=run_id, step=step)
    url = request.app.url_path_for("step_page", run_id=run_id, step=found)
    return RedirectResponse(str(url), status_code=303)


@router.get("/runs/{run_id}/steps/{step}", name="step_page")
def step_page(
    request: Request, session: SessionDep, run_id: int, step: int, group: int = 0
) -> HTMLResponse:
    detail = queries.step_detail(session, run_id=run_id, step=step)
    groups = detail["groups"]
    if groups and not 0 <= group < len(groups):
        raise NotFound(f"step {step} of run {run_id} has no group {group}")
    shown = groups[group] if groups else None
    if shown is not None:
        for rollout in shown["rollouts"]:
            rollout["cells"] = viewer.token_cells(rollout)
            rollout["control_rows"] = viewer.control_rows(rollout)
    context = {"d": detail, "run": detail["run"], "group": shown, "group_index": group}
    return render(request, "step.html", context)


@router.get("/runs/{run_id}/steps/{step}/card", name="step_card")
def step_card(request: Request, session: SessionDep, run_id: int, step: int) -> HTMLResponse:
    """The compact step card the compare page swaps in when its step control moves."""
    detail = queries.step_detail(session, run_id=run_id, step=step)
    return render(request, "_step_card.html", {"d": detail, "run": detail["run"]})


@router.get("/compare", name="compare_page")
def compare_page(
    request: Request,
    session: SessionDep,
    runs: Annotated[list[str] | None, Query()] = None,
    step: int | None = None,
) -> HTMLResponse:
    data = queries.compare(session, run_ids=run_ids(runs), step=step)
    figs = figures.compare_figures(data["runs"], data["series"], vocab.COMPARE_SERIES)
    # Run i is drawn in RUN_COLORS[i]; templates use the matching CSS class run-c{i}.
    colors = {run["id"]: i % len(figures.RUN_COLORS) for i, run in enumerate(data["runs"])}
    page = {
        "figures": figs["main"] + figs["control"] + figs["evaluation"] + figs["collapse"],
        "step": data["step"],
        "max_step": data["max_step"],
        "pair": [s["run_id"] for s in data["side_by_side"]],
        "steps": {
            s["run_id"]: str(request.app.url_path_for("step_jump", run_id=s["run_id"]))
            for s in data["side_by_side"]
        },
    }
    # Evaluation columns only when some run evaluated (runs without it would show dashes).
    evaluated = {n for summary in data["summary"] for n, v in summary["final_eval"].items() if v}
    eval_columns = [(n, label) for n, label in EVAL_COLUMNS if n in evaluated]
    context = {
        "c": data,
        "figures": figs,
        "colors": colors,
        "page": page,
        "eval_columns": eval_columns,
    }
    return render(request, "compare.html", context)
