"""HTML pages: runs, run, step viewer, compare (each has a JSON twin in server/webapp/routes/api.py).

Each handler parses its parameters, reads through one query, and renders what server.webapp.pages.page_context makes
of it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import ValidationError
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.webapp import alert_hooks, queries
from rollout_lens.server.webapp.http import flash
from rollout_lens.server.webapp.http.deps import (
    AlertCacheDep,
    CompareCacheDep,
    SessionDep,
    TokenTextsDep,
    model_builds,
    render,
)
from rollout_lens.server.webapp.http.params import (
    MAX_ID,
    GroupNo,
    GroupOrder,
    GroupSort,
    Look,
    Offset,
    OptionalGroup,
    OptionalRunId,
    OptionalStep,
    RangeFrom,
    RangeTo,
    RunId,
    RunsPage,
    RunsPerPage,
    StepNo,
    TokenShade,
    run_ids,
)
from rollout_lens.server.webapp.http.responses import memo, run_alerts
from rollout_lens.server.webapp.pages import launch_fields, mismatch_page, page_context
from rollout_lens.server.webapp.queries.budget import VIEW_TOKENS

router = APIRouter(include_in_schema=False)
CardGroup = Annotated[int, Query(ge=0, le=MAX_ID, description="the group shown")]


def _url(request: Request) -> page_context.Url:
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
    context = page_context.runs_page(data, _url(request), q=q, sort=sort, order=order)
    return render(request, "runs.html", context)


@router.get("/runs/new", name="new_run_page")
def new_run_page(
    request: Request, session: SessionDep, preset: str = "", clone: OptionalRunId = None
) -> HTMLResponse:
    """The launch form: its defaults, a preset's values, or a run's config (Clone)."""
    source = None if clone is None else queries.run_card(session, run_id=clone)
    context = launch_fields.start_form(preset, source, model_builds(request))
    return render(request, "new_run.html", context)


@router.get("/runs/{run_id}", name="run_page")
def run_page(
    request: Request,
    session: SessionDep,
    cache: AlertCacheDep,
    run_id: RunId,
    full: bool = False,
) -> HTMLResponse:
    """A run's page, with the notice a form action left for it (server.webapp.http.flash), if any."""
    overview = queries.run_overview(session, run_id=run_id)
    overview["alerts"] = run_alerts(request, session, cache, run_id)
    notice = flash.read(request)
    deliveries = alert_hooks.failed_deliveries(session, run_id=run_id)
    context = page_context.run_page(
        overview, _url(request), full=full, notice=notice, deliveries=deliveries
    )
    response = render(request, "run.html", context)
    flash.forget(request, response, path=request.url.path)
    return response


@router.get("/runs/{run_id}/rollouts", name="explorer_page", response_model=None)
def explorer_page(
    request: Request, session: SessionDep, run_id: RunId
) -> HTMLResponse | RedirectResponse:
    """The rollout explorer: a run's rollouts across steps, filtered, searched and sorted. The
    form's empty fields are dropped from the URL (one redirect); a value that does not parse
    keeps the reader here, its field marked and the reason beside it."""
    given = request.query_params.multi_items()
    kept = [(name, value) for name, value in given if value.strip()]
    if len(kept) < len(given):
        return RedirectResponse(page_context.explorer_path(_url(request), run_id, kept), 303)
    try:
        query = queries.RolloutQuery.model_validate(dict(kept))
        data = queries.explore(session, run_id=run_id, query=query)
    except (ValidationError, InvalidInput) as exc:
        run = queries.run_card(session, run_id=run_id)
        context = page_context.explorer_invalid(run, dict(kept), exc, _url(request))
        # The API's statuses: 422 for a value that does not parse, 400 for one it cannot use.
        status = 422 if isinstance(exc, ValidationError) else 400
        return render(request, "explorer.html", context, status_code=status)
    return render(
        request, "explorer.html", page_context.explorer_page(data, _url(request), run_id=run_id)
    )


@router.get("/runs/{run_id}/mismatch", name="mismatch_page")
def mismatch_drill_page(
    request: Request,
    session: SessionDep,
    run_id: RunId,
    step: OptionalStep = None,
    first: RangeFrom = None,
    to: RangeTo = None,
) -> HTMLResponse:
    """The mismatch drill-down of a step (`step`) or a range of steps (`from`, `to`): the
    histogram of token log-ratios, generator vs trainer probability, the table by probability
    and the worst tokens, each linked to its rollout (the run's last step by default)."""
    data = queries.mismatch_drill(session, run_id=run_id, step=step, first=first, last=to)
    return render(request, "mismatch.html", mismatch_page.mismatch_page(data, _url(request)))


@router.get("/runs/{run_id}/steps", name="step_jump")
def step_jump(
    request: Request,
    session: SessionDep,
    run_id: RunId,
    step: OptionalStep = None,
    group: OptionalGroup = None,
    shade: TokenShade = "probability",
) -> RedirectResponse:
    """The recorded step nearest `step`; with `group`, that group's page when the step has it
    (else the step's groups overview); the tokens shaded as they were (`shade`)."""
    found = queries.resolve_step(session, run_id=run_id, step=step)
    if group is not None and queries.has_group(session, run_id=run_id, step=found, group=group):
        url = str(request.app.url_path_for("group_page", run_id=run_id, step=found, group=group))
    else:
        url = str(request.app.url_path_for("step_page", run_id=run_id, step=found))
    return RedirectResponse(url + ("?shade=ratio" if shade == "ratio" else ""), status_code=303)


@router.get("/runs/{run_id}/steps/{step}", name="step_page", response_model=None)
def step_page(
    request: Request,
    session: SessionDep,
    texts: TokenTextsDep,
    run_id: RunId,
    step: StepNo,
    sort: GroupSort = "group",
    order: GroupOrder = "asc",
    look: Look = None,
    offset: Offset = 0,
    group: OptionalGroup = None,
    shade: TokenShade = "probability",
) -> HTMLResponse | RedirectResponse:
    """A step: its groups overview, or with one group that group's rollouts (as before groups
    had pages), their tokens shaded by `shade`. `?group=` (the old group switch) is that
    group's page now."""
    if group is not None:
        url = request.app.url_path_for("group_page", run_id=run_id, step=step, group=group)
        return RedirectResponse(str(url), status_code=307)
    overview = queries.step_groups(
        session,
        run_id=run_id,
        step=step,
        sort=sort,
        descending=order == "desc",
        look=look,
        offset=offset,
        limit=queries.GROUPS_PER_PAGE,
    )
    detail = None
    if overview["groups_in_step"] == 1 and look is None:
        only = overview["groups"][0]["group"]
        detail = queries.group_detail(
            session,
            run_id=run_id,
            step=step,
            group=only,
            max_tokens=VIEW_TOKENS,
            limit=queries.GROUP_TABS,
            page_budget=True,
            texts_kept=texts,
        )
    mismatch = queries.has_generator_side(
        session, run_id=run_id, step=overview["step"]["rollout_step"]
    )
    context = page_context.step_page(
        overview, _url(request), detail=detail, shade=shade, mismatch=mismatch
    )
    return render(request, "step.html", context)


@router.get("/runs/{run_id}/steps/{step}/groups/{group}", name="group_page")
def group_page(
    request: Request,
    session: SessionDep,
    texts: TokenTextsDep,
    run_id: RunId,
    step: StepNo,
    group: GroupNo,
    shade: TokenShade = "probability",
) -> HTMLResponse:
    """One group of a step: its rollouts #0…#G−1 (tabs, tokens shaded by `shade`) and a table
    of all of them."""
    detail = queries.group_detail(
        session,
        run_id=run_id,
        step=step,
        group=group,
        max_tokens=VIEW_TOKENS,
        limit=queries.GROUP_TABS,
        page_budget=True,
        texts_kept=texts,
    )
    return render(request, "group.html", page_context.group_page(detail, shade))


@router.get("/runs/{run_id}/steps/{step}/card", name="step_card")
def step_card(
    request: Request,
    session: SessionDep,
    texts: TokenTextsDep,
    run_id: RunId,
    step: StepNo,
    group: CardGroup = 0,
) -> HTMLResponse:
    """The compact step card the compare page swaps in when its step control moves: one group
    (the first, or `group`), saying how many the step has."""
    detail = queries.step_card(session, run_id=run_id, step=step, group=group, texts_kept=texts)
    return render(request, "_step_card.html", {"detail": detail, "run": detail["run"]})


@router.get("/compare", name="compare_page")
def compare_page(
    request: Request,
    session: SessionDep,
    cache: CompareCacheDep,
    texts: TokenTextsDep,
    runs: Annotated[list[str] | None, Query()] = None,
    step: OptionalStep = None,
    group: CardGroup = 0,
) -> HTMLResponse:
    data = queries.compare(
        session,
        run_ids=run_ids(runs),
        step=step,
        group=group,
        memo=memo(cache),
        texts_kept=texts,
    )
    return render(request, "compare.html", page_context.compare_page(data, _url(request)))
