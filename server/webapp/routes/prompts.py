"""The prompt lens's JSON API: a run's prompts, their heatmap, one prompt's history, the same
prompts across runs, and the prompts a filter selects as a dataset (JSON Lines)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import StreamingResponse
from rollout_lens.server import store
from rollout_lens.server.webapp import queries
from rollout_lens.server.webapp.http import api_models
from rollout_lens.server.webapp.http.deps import SessionDep
from rollout_lens.server.webapp.http.params import RunId, run_ids
from rollout_lens.server.webapp.http.responses import JSON_LINES, DataResponse, encode, json_lines
from rollout_lens.server.webapp.queries import prompts as lens
from rollout_lens.server.webapp.queries.prompt_rollouts import MAX_ROLLOUTS
from sqlalchemy.orm import Session, sessionmaker

router = APIRouter(prefix="/api", tags=["prompts"])

PromptId = Annotated[int, Path(ge=1, le=2**63 - 1, description="a prompt's id (prompt_id)")]
Cursor = Annotated[str | None, Query(max_length=4096, description="the `next` of a page")]


@router.get(
    "/runs/{run_id}/prompts",
    name="api_run_prompts",
    response_class=DataResponse,
    summary="List a run's prompts",
    responses={200: {"model": api_models.PromptsPage}},
)
def list_prompts(
    session: SessionDep, run_id: RunId, query: Annotated[queries.PromptQuery, Query()]
) -> DataResponse:
    """Every distinct prompt of the run with what happened to it: groups, first and last step,
    mean reward and true score, the first step it was solved by majority, the last it failed,
    its flips between the two, its share of groups without reward spread and its top votes.
    Filtered (`look`: never_solved, solved, flipping, stuck, forgotten; `q`: words in the
    prompt), sorted by any figure, a page at a time: pass `next` back as `after`."""
    return DataResponse(queries.prompts_page(session, run_id=run_id, query=query))


@router.get(
    "/runs/{run_id}/prompts/heatmap",
    name="api_prompts_heatmap",
    response_class=DataResponse,
    summary="Get a run's prompts heatmap",
    responses={200: {"model": api_models.PromptHeatmap}},
)
def prompts_heatmap(
    session: SessionDep,
    run_id: RunId,
    query: Annotated[lens.HeatmapQuery, Query()],
) -> DataResponse:
    """Prompts × steps, a page of the prompts list's rows (its filters, order and cursor): each
    cell a step, or a bucket of `bucket` steps when the run has more than `width`, valued by its
    groups' true score (reward where none is known), naming the group the step viewer opens."""
    return DataResponse(queries.heatmap(session, run_id=run_id, query=query, width=query.width))


@router.get(
    "/runs/{run_id}/prompts/export.jsonl",
    name="export_prompts",
    response_class=StreamingResponse,
    summary="Export a run's prompts as a dataset",
    responses=json_lines("a prompt"),
)
def export_prompts(
    request: Request,
    session: SessionDep,
    run_id: RunId,
    query: Annotated[queries.PromptQuery, Query()],
) -> StreamingResponse:
    """The prompts the filters select (e.g. look=never_solved), all of them, as JSON Lines in
    the chat format a TRL script reads: `{"prompt": [{"role", "content"}, …], "target", …}`."""
    store.get_run(session, run_id=run_id)  # a 404 now, not a broken download later
    if query.q is not None:  # a bad search is a 400 now too
        lens.prompts_page(session, run_id=run_id, query=query.model_copy(update={"limit": 1}))
    look = f"-{query.look}" if query.look else ""
    return StreamingResponse(
        _lines(request.app.state.session_factory, run_id, query),
        media_type=JSON_LINES,
        headers={"Content-Disposition": f'attachment; filename="run-{run_id}-prompts{look}.jsonl"'},
    )


def _lines(
    factory: sessionmaker[Session], run_id: int, query: queries.PromptQuery
) -> Iterator[bytes]:
    with factory() as session:
        for row in queries.export_prompts(session, run_id=run_id, query=query):
            yield encode(row) + b"\n"


@router.get(
    "/runs/{run_id}/prompts/{prompt_id}",
    name="api_prompt_history",
    response_class=DataResponse,
    summary="Get a prompt's history",
    responses={200: {"model": api_models.PromptHistory}},
)
def prompt_history(
    session: SessionDep,
    run_id: RunId,
    prompt_id: PromptId,
    after: Cursor = None,
    limit: Annotated[
        int,
        Query(
            ge=1, le=lens.MAX_HISTORY, description=f"groups a page (default {lens.HISTORY_PAGE})"
        ),
    ] = lens.HISTORY_PAGE,
    completions: Annotated[
        bool,
        Query(
            description="each group's completions too (their heads; a page then holds at most "
            f"{MAX_ROLLOUTS:,} rollouts)"
        ),
    ] = False,
) -> DataResponse:
    """Every group of one prompt of the run in step order: its rewards, true scores, advantages,
    votes, agreement, zero spread, its rollouts' states and ids, and with completions=true their
    completions (a rollout whole: /api/runs/{run_id}/steps/{step}/groups/{group}), with the
    prompt's figures and text."""
    return DataResponse(
        queries.prompt_history(
            session,
            run_id=run_id,
            prompt_id=prompt_id,
            after=after,
            limit=limit,
            completions=completions,
        )
    )


@router.get(
    "/compare/prompts",
    name="api_compare_prompts",
    response_class=DataResponse,
    summary="Compare runs prompt by prompt",
    responses={200: {"model": api_models.ComparePrompts}},
)
def compare_prompts(
    session: SessionDep,
    runs: Annotated[list[str], Query(description="two to four run ids, comma-separated")],
    match: Annotated[
        Literal["query", "user", "exact"],
        Query(
            description="how prompts are matched: query (the query its env named, else its "
            "last user turn), user (its last user turn), exact (the same text)"
        ),
    ] = "query",
    q: Annotated[
        str | None, Query(max_length=4096, description="words that must all appear in the prompt")
    ] = None,
    every: Annotated[bool, Query(description="only prompts that every run has")] = True,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=lens.MAX_PAGE, description="matches a page")] = 50,
) -> DataResponse:
    """The runs' prompts matched across them, each run's figures side by side, by label."""
    return DataResponse(
        queries.compare_prompts(
            session,
            run_ids=run_ids(runs),
            match=match,
            q=q,
            every=every,
            after=after,
            limit=limit,
        )
    )
