"""HTML pages: runs, run, step viewer, compare (each has a JSON twin in server/routes/api.py).

Each handler parses its parameters, reads through one query, and renders what server.views makes
of it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from rollout_lens.server import launch, queries, views
from rollout_lens.server.deps import (
    AlertCacheDep,
    CompareCacheDep,
    SessionDep,
    model_builds,
    render,
)
from rollout_lens.server.params import (
    OptionalRunId,
    OptionalStep,
    RunId,
    RunsPage,
    RunsPerPage,
    StepNo,
    run_ids,
)
from rollout_lens.server.responses import memo, run_alerts
from rollout_lens.server.viewer import VIEW_TOKENS

router = APIRouter(include_in_schema=False)


def _url(request: Request) -> views.Url:
    def url(name: str, **params: Any) -> str:
        return str(request.app.url_path_for(name, **params))

    return url


@router.get("/", name="runs_page")
def runs_page(
    request: Request,
    session: SessionDep,
    q: str = "",
    sort: str = "created",
    order: Literal["asc", "desc"] = "desc",
    page: RunsPage = 1,
    per_page: RunsPerPage = queries.RUNS_PER_PAGE,
) -> HTMLResponse:
    data = queries.runs_page(
        session, q=q, sort=sort, descending=order == "desc", page=page, per_page=per_page
    )
    context = views.runs_page(data, _url(request), q=q, sort=sort, order=order)
    return render(request, "runs.html", context)


@router.get("/runs/new", name="new_run_page")
def new_run_page(
    request: Request, session: SessionDep, preset: str = "", clone: OptionalRunId = None
) -> HTMLResponse:
    """The launch form: its defaults, a preset's values, or a run's config (Clone)."""
    source = None if clone is None else queries.run_card(session, run_id=clone)
    context = launch.start_form(preset, source, model_builds(request))
    return render(request, "new_run.html", context)


@router.get("/runs/{run_id}", name="run_page")
def run_page(
    request: Request,
    session: SessionDep,
    cache: AlertCacheDep,
    run_id: RunId,
    full: bool = False,
    notice: str = "",
) -> HTMLResponse:
    overview = queries.run_overview(session, run_id=run_id)
    overview["alerts"] = run_alerts(request, session, cache, run_id)
    context = views.run_page(overview, _url(request), full=full, notice=notice)
    return render(request, "run.html", context)


@router.get("/runs/{run_id}/steps", name="step_jump")
def step_jump(
    request: Request, session: SessionDep, run_id: RunId, step: OptionalStep = None
) -> RedirectResponse:
    found = queries.resolve_step(session, run_id=run_id, step=step)
    url = request.app.url_path_for("step_page", run_id=run_id, step=found)
    return RedirectResponse(str(url), status_code=303)


@router.get("/runs/{run_id}/steps/{step}", name="step_page")
def step_page(
    request: Request, session: SessionDep, run_id: RunId, step: StepNo, group: int = 0
) -> HTMLResponse:
    detail = queries.step_detail(session, run_id=run_id, step=step, max_tokens=VIEW_TOKENS)
    return render(request, "step.html", views.step_page(detail, group))


@router.get("/runs/{run_id}/steps/{step}/card", name="step_card")
def step_card(request: Request, session: SessionDep, run_id: RunId, step: StepNo) -> HTMLResponse:
    """The compact step card the compare page swaps in when its step control moves."""
    detail = queries.step_detail(session, run_id=run_id, step=step, max_tokens=VIEW_TOKENS)
    return render(request, "_step_card.html", {"d": detail, "run": detail["run"]})


@router.get("/compare", name="compare_page")
def compare_page(
    request: Request,
    session: SessionDep,
    cache: CompareCacheDep,
    runs: Annotated[list[str] | None, Query()] = None,
    step: OptionalStep = None,
) -> HTMLResponse:
    data = queries.compare(
        session, run_ids=run_ids(runs), step=step, max_tokens=VIEW_TOKENS, memo=memo(cache)
    )
    return render(request, "compare.html", views.compare_page(data, _url(request)))
