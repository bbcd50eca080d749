"""The JSON API: every page's data, plus chart series with a cursor for live updates."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from rollout_lens.server.webapp import queries
from rollout_lens.server.webapp.http import api_models
from rollout_lens.server.webapp.http.deps import (
    AlertCacheDep,
    CacheDep,
    CompareCacheDep,
    SessionDep,
    TokenTextsDep,
)
from rollout_lens.server.webapp.http.params import (
    MAX_ID,
    GroupNo,
    GroupOrder,
    GroupSort,
    Look,
    Offset,
    OptionalStep,
    RangeFrom,
    RangeTo,
    RunId,
    RunsPage,
    RunsPerPage,
    StepNo,
    run_ids,
    series_names,
)
from rollout_lens.server.webapp.http.responses import (
    DataResponse,
    alerts_of_runs,
    memo,
    run_alerts,
    versioned,
    with_step_urls,
)
from rollout_lens.server.webapp.pages import launch_fields, mismatch_page, page_context
from rollout_lens.server.webapp.queries import chart_data

router = APIRouter(prefix="/api", tags=["runs"])

Order = Literal["asc", "desc"]


def _url(request: Request) -> page_context.Url:
    def url(name: str, **params: object) -> str:
        return str(request.app.url_path_for(name, **params))

    return url


@router.get(
    "/runs",
    response_class=DataResponse,
    summary="List runs",
    responses={200: {"model": api_models.RunsPage}},
)
def list_runs(
    request: Request,
    session: SessionDep,
    q: Annotated[
        str, Query(description="words that must all appear in name, model, variant or status")
    ] = "",
    sort: Annotated[str, Query(description=f"one of {', '.join(queries.RUN_SORTS)}")] = "created",
    order: Order = "desc",
    ids: Annotated[
        list[str] | None, Query(description="only these run ids (comma-separated)")
    ] = None,
    after: Annotated[
        int | None, Query(ge=0, le=MAX_ID, description="only runs newer than this id (or in ids)")
    ] = None,
    page: RunsPage = 1,
    per_page: RunsPerPage = queries.RUNS_PER_PAGE,
) -> DataResponse:
    """One page of runs with status, progress and last-25-step figures (the runs page): `runs`,
    how many match (`total`, `pages`), which of them these are (`first`, `last`), the newest
    matching id, and `links.prev` / `links.next` (null at either end)."""
    wanted = run_ids(ids) if ids else None
    data = queries.runs_page(
        session,
        q=q,
        sort=sort,
        descending=order == "desc",
        page=page,
        per_page=per_page,
        ids=wanted,
        after=after,
    )
    return DataResponse(page_context.runs_json(data, _url(request), q=q, sort=sort, order=order))


@router.get(
    "/runs/{run_id}",
    response_class=DataResponse,
    summary="Get a run",
    responses={200: {"model": api_models.RunOverview}},
)
def get_run(
    request: Request, session: SessionDep, cache: AlertCacheDep, run_id: RunId
) -> DataResponse:
    """A run's card, its first and last recorded steps, the names of its series, its live state
    (place in the queue, speed, ETA) and its alerts (the run page)."""
    overview = queries.run_overview(session, run_id=run_id)
    return DataResponse(overview | {"alerts": run_alerts(request, session, cache, run_id)})


@router.get(
    "/runs/{run_id}/progress",
    response_class=DataResponse,
    summary="Get a run's live progress",
    responses={200: {"model": api_models.Progress}},
)
def get_progress(session: SessionDep, run_id: RunId) -> DataResponse:
    """A run's live state: status, step, place in the queue, steps per second, ETA, and whether
    it can be cancelled or resumed. Cheap (a few index seeks): what live pages poll."""
    return DataResponse(queries.run_live(session, run_id=run_id))


@router.get(
    "/runs/{run_id}/series",
    response_class=DataResponse,
    summary="Get a run's chart series",
    responses={200: {"model": api_models.Series}},
)
def get_series(
    request: Request,
    session: SessionDep,
    cache: CacheDep,
    run_id: RunId,
    names: Annotated[
        list[str] | None, Query(description="series names, comma-separated (default: all)")
    ] = None,
    since: Annotated[
        int, Query(ge=0, le=MAX_ID, description="only steps after this one (the cursor)")
    ] = 0,
    until: Annotated[
        int | None, Query(ge=0, le=MAX_ID, description="only steps up to this one")
    ] = None,
    full: Annotated[bool, Query(description="every step, never downsampled")] = False,
    max_points: Annotated[
        int, Query(ge=10, le=100_000, description="points per series before downsampling")
    ] = chart_data.MAX_POINTS,
) -> Response:
    """Chart series for steps in (since, until] with their 25-step buckets.

    Pass the response's `cursor` as the next `since` to receive only new steps. Long ranges are
    downsampled: see `method` in the response. Responses carry an ETag that changes with every
    recorded step; a full history (since=0) of an unchanged run is served from memory.
    """
    wanted = series_names(names)
    if wanted:
        known = queries.known_series(session, run_id=run_id)
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise _unknown_series(unknown, known)
    return versioned(
        request,
        session,
        cache,
        run_id,
        lambda: queries.series(
            session,
            run_id=run_id,
            names=wanted,
            since=since,
            until=until,
            max_points=None if full else max_points,
        ),
        keep=since == 0,  # live polls (since > 0) are small, and each is asked for once
    )


def _unknown_series(unknown: list[str], known: list[str]) -> RequestValidationError:
    """A 422 that names the series asked for that the run does not have, and those it has."""
    shown = ", ".join(known[:200]) + (f" (and {len(known) - 200} more)" if len(known) > 200 else "")
    message = f"unknown series {', '.join(unknown)}; this run has {shown}"
    error = {"type": "value_error", "loc": ("query", "names"), "msg": message, "input": unknown}
    return RequestValidationError([error])


@router.get(
    "/runs/{run_id}/alerts",
    response_class=DataResponse,
    summary="List a run's alerts",
    responses={200: {"model": list[api_models.Alert]}},
)
def get_alerts(
    request: Request,
    session: SessionDep,
    cache: CacheDep,
    run_id: RunId,
    since: Annotated[
        int, Query(ge=0, le=MAX_ID, description="only alerts after this step (the cursor)")
    ] = 0,
) -> Response:
    """Alerts (control-token spike, collapse, reward hacking, signal loss) with their steps."""
    return versioned(
        request,
        session,
        cache,
        run_id,
        lambda: with_step_urls(
            request, session, run_id, queries.alerts(session, run_id=run_id, since=since)
        ),
        keep=since == 0,
    )


@router.get(
    "/alerts",
    response_class=DataResponse,
    summary="List alerts of several runs",
    responses={200: {"model": dict[str, list[api_models.Alert]]}},
)
def list_alerts(
    request: Request,
    session: SessionDep,
    cache: AlertCacheDep,
    runs: Annotated[list[str], Query(description="run ids, comma-separated")],
) -> DataResponse:
    """Alerts of several runs at once (the runs page's badges): run id → alerts, oldest first,
    each with the URL of the step where it fired."""
    return DataResponse(alerts_of_runs(request, session, cache, run_ids(runs)))


@router.get(
    "/presets",
    response_class=DataResponse,
    summary="List launch presets and fields",
    responses={200: {"model": api_models.Presets}},
)
def list_presets() -> DataResponse:
    """The launch form as data: its presets and every RunConfig field with default, help and
    bounds (launch with POST /api/runs)."""
    return DataResponse(launch_fields.presets_data())


@router.get(
    "/runs/{run_id}/rollouts",
    response_class=DataResponse,
    summary="Find a run's rollouts",
    responses={200: {"model": api_models.Rollouts}},
)
def list_rollouts(
    request: Request,
    session: SessionDep,
    run_id: RunId,
    query: Annotated[queries.RolloutQuery, Query()],
) -> DataResponse:
    """A run's rollouts across steps, filtered (steps, group, state, format, vote, target,
    reward / true score / advantage / length ranges, verifier ≠ truth, alert steps), searched
    (`q`: words in completion or prompt, by the database's full-text index) and sorted, a page
    at a time: pass `next` back as `after`. `total` stops counting at 100,000
    (`total_capped`). Each row links to its step, group and rollout."""
    data = queries.explore(session, run_id=run_id, query=query)
    return DataResponse(page_context.explorer_urls(data, _url(request), run_id=run_id))


@router.get(
    "/runs/{run_id}/mismatch",
    name="api_mismatch",
    response_class=DataResponse,
    summary="Drill into a step's training–inference mismatch",
    responses={200: {"model": api_models.Mismatch}},
)
def get_mismatch(
    request: Request,
    session: SessionDep,
    run_id: RunId,
    step: OptionalStep = None,
    first: RangeFrom = None,
    to: RangeTo = None,
) -> DataResponse:
    """The generator's and the trainer's logprobs of a step's sampled tokens compared (`step`;
    none given: the run's last), or of a range of steps (`from`, `to`; read from `from` up to
    50 steps or 2,000,000 tokens, `steps.cut` and `links.next` say where it stopped): the
    histogram of log r = log p_trainer − log p_generator (the ×2 and ×5 bands' edges among its
    edges), mismatch by the generator's probability of the token, the worst tokens with links to
    their rollouts, and a bounded sample of (generator, trainer) logprob points. A run without
    generator logprobs answers with `generator_side` false and nothing compared."""
    data = queries.mismatch_drill(session, run_id=run_id, step=step, first=first, last=to)
    return DataResponse(mismatch_page.mismatch_json(data, _url(request)))


@router.get(
    "/runs/{run_id}/steps/{step}",
    response_class=DataResponse,
    summary="Get one step and its groups",
    responses={200: {"model": api_models.Step}},
)
def get_step(
    request: Request,
    session: SessionDep,
    run_id: RunId,
    step: StepNo,
    sort: GroupSort = "group",
    order: GroupOrder = "asc",
    look: Look = None,
    offset: Offset = 0,
    limit: Annotated[
        int,
        Query(
            ge=1,
            le=queries.MAX_GROUPS_PER_PAGE,
            description=f"groups per page (default {queries.GROUPS_PER_PAGE})",
        ),
    ] = queries.GROUPS_PER_PAGE,
) -> DataResponse:
    """One step: its metrics and neighbours, and its groups overview a page at a time: one
    summary a group (reward mean and spread, true accuracy, vote split and agreement, structural
    states, broken calls, verifier ≠ truth, solved/stuck, largest |advantage|), no rollouts.
    `total` groups match (`groups_in_step` in all); `links.next` / `links.prev` page them. A
    group's rollouts: `/api/runs/{run_id}/steps/{step}/groups/{group}`."""
    data = queries.step_groups(
        session,
        run_id=run_id,
        step=step,
        sort=sort,
        descending=order == "desc",
        look=look,
        offset=offset,
        limit=limit,
    )
    return DataResponse(page_context.step_json(data, _url(request)))


@router.get(
    "/runs/{run_id}/steps/{step}/groups/{group}",
    response_class=DataResponse,
    summary="Get one group of a step",
    responses={200: {"model": api_models.Group}},
)
def get_group(
    request: Request,
    session: SessionDep,
    texts: TokenTextsDep,
    run_id: RunId,
    step: StepNo,
    group: GroupNo,
    offset: Offset = 0,
    limit: Annotated[
        int,
        Query(
            ge=1,
            le=queries.MAX_ROLLOUTS_PER_PAGE,
            description=f"rollouts per page (default {queries.ROLLOUTS_PER_PAGE})",
        ),
    ] = queries.ROLLOUTS_PER_PAGE,
    max_tokens: Annotated[
        int,
        Query(
            ge=0,
            le=MAX_ID,
            description="per-token positions of each rollout (ids, logprobs, control-token "
            f"probabilities; default {queries.JSON_TOKENS}); `tokens_total` says how many it has",
        ),
    ] = queries.JSON_TOKENS,
) -> DataResponse:
    """One group of a step: its summary, vote histogram and rollouts (a page of `limit` from
    `offset`, `rollouts_total` in all, `next` the following page) with their per-token arrays
    cut to `max_tokens` positions and a `disagree` flag (verifier ≠ truth). No answer holds more
    than 16,384 positions (a page has fewer rollouts when each asks for many) nor more than
    500,000 characters of a completion or prompt shared by its rollouts (16,000 at least;
    `completion_chars` and `prompt_chars` say how many there are: the export has them whole)."""
    max_tokens = min(max_tokens, queries.JSON_POSITIONS)
    limit = min(limit, max(1, queries.JSON_POSITIONS // max(max_tokens, 1)))
    detail = queries.group_detail(
        session,
        run_id=run_id,
        step=step,
        group=group,
        max_tokens=max_tokens,
        offset=offset,
        limit=limit,
        texts_kept=texts,
    )
    return DataResponse(
        page_context.group_json(detail, _url(request), limit=limit, max_tokens=max_tokens)
    )


@router.get(
    "/compare",
    response_class=DataResponse,
    summary="Compare runs",
    responses={200: {"model": api_models.Compare}},
)
def get_compare(
    session: SessionDep,
    cache: CompareCacheDep,
    texts: TokenTextsDep,
    runs: Annotated[list[str], Query(description="two or more run ids, comma-separated")],
    step: Annotated[
        int | None, Query(ge=0, le=MAX_ID, description="the step shown side by side")
    ] = None,
    group: Annotated[
        int, Query(ge=0, le=MAX_ID, description="the group of that step shown side by side")
    ] = 0,
) -> DataResponse:
    """Runs side by side: series, summary (convergence, stability, cost), config diff, one group
    of one step (its rollouts' per-token arrays cut to the group JSON's default positions)."""
    data = queries.compare(
        session,
        run_ids=run_ids(runs),
        step=step,
        group=group,
        max_tokens=queries.JSON_TOKENS,
        memo=memo(cache),
        texts_kept=texts,
    )
    return DataResponse(page_context.compare_json(data))
